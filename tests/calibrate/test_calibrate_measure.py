"""The measurer on the CPU: the real kernel package (its PyTorch path) and the runner's Block, tiny shapes.

Host-clock times only check the plumbing (every term timed, the realised kept fractions recorded); the
GPU numbers come from calibrate.run on the device.
"""
from __future__ import annotations

import pytest
import torch

import sparsebalance.kernels.sparse_attention as kernel
from sparsebalance.calibrate import run, store, timing
from sparsebalance.calibrate.grid import GridPoint
from sparsebalance.calibrate.measure import Measurer, _pass_through
from sparsebalance.sim.shapes import ModelShape
from sparsebalance.runner.attention import make_attention

BLOCK = 32
TINY = ModelShape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=100,
                  max_context=4096)


@pytest.fixture(scope="module")
def measurer():
    return Measurer([TINY], kernel, make_attention("kernel", BLOCK), timing.bench_cpu, device="cpu",
                    dtype=torch.float32, block_size=BLOCK)


POINTS = [
    GridPoint("attn", "tiny", (256, 128), (0.25, 1.0)),
    GridPoint("layer", "tiny", (256, 128), (1.0, 1.0)),
    GridPoint("layer_full", "tiny", (200, 77), (0.3, 1.0), "validate"),
]


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.kind)
def test_every_term_is_timed_with_the_realised_kept_fractions(measurer, point):
    rows = measurer.measure(point)
    assert [r["term"] for r in rows] == list(point.terms)
    for r in rows:
        assert float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"]) and float(r["median_ms"]) > 0
        assert r["reps"] == timing.MIN_REPS and r["split"] == point.split
        kept = [float(x) for x in r["kept_fractions"].split(";")]
        assert len(kept) == len(point.lengths) and kept[1] == 1.0
        if point.kind != "layer":
            # 256 tokens = 8 blocks, 36 causal pairs: a quarter rounds up per query block, never below it.
            assert point.kept_fractions[0] < kept[0] < 1.0


@pytest.mark.slow  # times every term of three grid points on the CPU
def test_measured_rows_go_to_the_csv(tmp_path, measurer):
    csv = tmp_path / "raw.csv"
    assert run.measure_all(POINTS, measurer, csv, time_budget_s=None) == len(POINTS)
    assert run.pending(POINTS, csv) == []
    assert len(store.read_rows(csv)) == sum(len(p.terms) for p in POINTS)


def test_pass_through_attention_sends_gradient_to_q_only():
    q, k, v = (torch.randn(10, h, 8, requires_grad=True) for h in (4, 2, 2))
    out, kept, coverage = _pass_through(q, k, v, kernel.VarlenBatch.from_cu_seqlens(
        torch.tensor([0, 6, 10], dtype=torch.int32)), (torch.ones(2), None))
    out.sum().backward()
    assert torch.equal(out, q) and kept.tolist() == [1.0, 1.0] == coverage.tolist()
    assert torch.equal(q.grad, torch.ones_like(q)) and k.grad is None and v.grad is None


def test_bench_cpu_returns_quantiles_of_min_reps_calls():
    calls = []
    t = timing.bench_cpu(lambda: calls.append(1), expected_ms=1.0)
    assert len(calls) == timing.MIN_REPS + 1 and t.reps == timing.MIN_REPS
    assert 0 <= t.p20_ms <= t.median_ms <= t.p80_ms


def test_heat_runs_the_call_back_to_back_for_its_window_and_clears_grads():
    """Every call is followed by the sync (the GPU finishes it before the clock is read), grads are cleared
    before each call, and the window holds at least one call however long a call takes. A stand-in clock that
    each call advances by 2 ms: the count does not depend on how busy the machine is."""
    events, x, now = [], torch.ones(1, requires_grad=True), [0.0]

    def call():
        assert x.grad is None
        x.grad = torch.ones(1)
        events.append("call")
        now[0] += 0.002

    calls = timing.heat(call, lambda: events.append("sync"), [x], heat_ms=20.0, clock=lambda: now[0])
    assert calls == 10 and events == ["call", "sync"] * calls
    assert timing.heat(call, lambda: None, [x], heat_ms=0.0, clock=lambda: now[0]) == 1
    now[0] = 0.0
    assert timing.heat(lambda: now.__setitem__(0, now[0] + 1.0), lambda: None, heat_ms=20.0,
                       clock=lambda: now[0]) == 1
