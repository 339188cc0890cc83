"""calibrate.memory's measuring side on the CPU: the runner's Block at a tiny shape through the kernel
package's PyTorch path, with a stand-in for the CUDA allocator's counters; and its command line."""
from __future__ import annotations

import csv
import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsebalance.calibrate.memory import COLUMNS, Measurer, build_points, measure_all, warm_up
from sparsebalance.calibrate.memory import main as memory_main
from sparsebalance.calibrate.store import append_rows
from sparsebalance.runner.attention import make_attention
from sparsebalance.sim.shapes import ModelShape

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
TINY = ModelShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100,
                  max_context=4096)


class FakeProbe:
    """Counters that rise by known steps: base 1000, after the forward +300 (peak +350), backward peak +900."""

    def __init__(self):
        self.calls = []
        self.allocated_values = iter([])
        self.peak_values = iter([])

    def sync(self):
        self.calls.append("sync")

    def reset_peak(self):
        self.calls.append("reset")
        self.allocated_values = iter([1000, 1300])
        self.peak_values = iter([1350, 1900])

    def allocated(self):
        return next(self.allocated_values)

    def peak(self):
        return next(self.peak_values)


@pytest.fixture(scope="module")
def measurer():
    # Measurer.measure collects garbage before every point. Frozen, the objects this test process made before
    # (importing torch alone makes hundreds of thousands) are not scanned again each time; a point's own garbage
    # still is.
    gc.freeze()
    yield Measurer([TINY], make_attention("kernel", BLOCK), FakeProbe(), "cpu", torch.float32, BLOCK)
    gc.unfreeze()


def test_points_pack_unique_lengths_smallest_token_count_first():
    points = build_points(["a", "b"], (256, 128))
    assert [p.tokens for p in points] == [128] * 16 + [256] * 16
    assert len({p.lengths for p in points}) == len(points)  # a fresh block layout in every point
    assert all(sum(p.lengths) == p.tokens and min(p.lengths) > 0 for p in points)
    assert {(p.layers, p.checkpointing, p.kept_fraction) for p in points} == {
        (layers, ckpt, kept) for layers in (1, 2) for ckpt in (False, True) for kept in (1.0, 0.3)}


@pytest.mark.slow
def test_rows_are_relative_to_the_bytes_before_the_point(measurer):
    for point in build_points(["tiny"], (64,)):
        row = measurer.measure(point)
        assert set(row) == set(COLUMNS)
        # input and output are both [tokens, hidden]: the stage's input counts as much as its output does not
        got = (row["base_bytes"], row["held_bytes"], row["forward_peak_bytes"], row["peak_bytes"])
        assert got == (1000, 300, 350, 900)
        assert row["lengths"].count(";") == 3 and row["tokens"] == 64


@pytest.mark.slow
def test_measure_all_appends_a_row_per_point_and_stops_at_the_time_budget(measurer, tmp_path):
    points = build_points(["tiny"], (64,))  # every combination of one token count
    out = tmp_path / "memory_raw.csv"
    warm_up(points, measurer)
    assert measure_all(points, measurer, out, time_budget_s=1e9) == len(points)
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(points) and list(rows[0]) == list(COLUMNS)
    assert measure_all(points, measurer, tmp_path / "none.csv", time_budget_s=-1) == 0


def test_append_row_refuses_unknown_columns(tmp_path):
    with pytest.raises(ValueError):
        append_rows(tmp_path / "x.csv", [{"nope": 1}], COLUMNS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the one-line refusal is for machines without CUDA")
def test_measuring_without_cuda_is_one_line_and_writes_nothing(tmp_path, capsys):
    code, stderr = cli(capsys, "--out", str(tmp_path / "m"))
    assert code == 2 and stderr.strip().splitlines() == [
        "error: python -m calibrate.memory --out needs CUDA (torch.cuda.is_available() is False here); measure on a "
        "GPU machine, fit the CSV anywhere with --fit"]
    assert list(tmp_path.iterdir()) == []


def cli(capsys, *args) -> tuple[int, str]:
    """The command line's exit code and stderr, in this process (its main under one_line_errors exits on bad
    input)."""
    with pytest.raises(SystemExit) as exited:
        memory_main(list(args))
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    ([], "one of the arguments --out --fit is required"),
    (["--out", "{tmp}/m", "--models", "gpt5"], "--models gpt5: no such model config; allowed: llama3-8b, qwen2.5-3b"),
    (["--out", "{tmp}/m", "--block-size", "96"], "--block-size 96: allowed: 64 or 128"),
    (["--out", "{tmp}/m", "--time-budget-s", "0"], "--time-budget-s 0.0: allowed: a number of seconds > 0"),
    (["--fit", "{tmp}/none.csv"], "no such file"),
    (["--out", "{tmp}/m", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, needle):
    code, stderr = cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], stderr
    assert list(tmp_path.iterdir()) == []


GPU_BOX = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):  # what the GPU machines lack
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "simpy", "scipy"):
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, Absent())
import torch
import sparsebalance.calibrate.memory as m
from sparsebalance.calibrate.run import machine_facts
from sparsebalance.runner.attention import make_attention
from sparsebalance.sim.shapes import ModelShape
tiny = ModelShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100, max_context=4096)
class Probe:
    sync = reset_peak = lambda self: None
    allocated = peak = lambda self: 0
measurer = m.Measurer([tiny], make_attention("kernel", 16), Probe(), "cpu", torch.float32, 16)
m.measure_all(m.build_points(["tiny"], (64,)), measurer, __import__("pathlib").Path(sys.argv[1]), 1e9)
machine_facts("cpu")
print("ok")
"""


@pytest.mark.slow
def test_the_measuring_side_needs_no_hydra_omegaconf_simpy_or_scipy(tmp_path):
    proc = subprocess.run([sys.executable, "-c", GPU_BOX, str(tmp_path / "rows.csv")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
