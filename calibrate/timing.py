"""Timing one callable: median and spread in ms.

On a GPU this is ``triton.testing.do_bench`` (device events, warm-up, L2 flushed before each repetition).
On the CPU (tests, interpreter dry runs) do_bench has no device to time, so a host clock stands in; those
numbers only check the plumbing and are never fitted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

WARMUP_MS = 5.0
REP_MS = 30.0
MIN_REPS = 3


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    @classmethod
    def of(cls, times_ms: list[float]) -> Timing:
        t = np.asarray(times_ms, dtype=float)
        p20, p50, p80 = np.quantile(t, [0.2, 0.5, 0.8])
        return cls(float(p50), float(p20), float(p80), len(t))


def bench_gpu(fn: Callable[[], object], expected_ms: float, grad_to_none: list | None = None) -> Timing:
    """do_bench with the repetition window stretched so that even long calls get MIN_REPS repetitions."""
    from triton.testing import do_bench

    rep = max(REP_MS, MIN_REPS * expected_ms)
    times = do_bench(fn, warmup=WARMUP_MS, rep=rep, grad_to_none=grad_to_none, return_mode="all")
    return Timing.of(times)


def bench_cpu(fn: Callable[[], object], expected_ms: float, grad_to_none: list | None = None) -> Timing:
    """Host-clock stand-in with do_bench's shape: one warm-up call, then MIN_REPS timed calls."""
    fn()
    times = []
    for _ in range(MIN_REPS):
        for x in grad_to_none or ():
            x.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing.of(times)
