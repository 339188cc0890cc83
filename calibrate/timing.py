"""Timing one callable: median and spread in ms.

On a GPU there are two clocks. ``bench_gpu_busy`` (what ``calibrate.run`` fits by default) sums the durations
of the kernels each call launches, read from ``torch.profiler``: a training step launches layer after layer
without waiting for the GPU, so the host's launch gaps inside a call overlap earlier work and only the GPU's
busy time adds up. ``bench_gpu`` is ``triton.testing.do_bench`` (device events around the call, so host gaps
count), which small, host-bound calls need when they run alone. Both flush L2 before each repetition, and
both first run the call back-to-back for HEAT_MS (:func:`heat`), so that every point is timed at the clocks
of sustained work, as a training step runs.
On the CPU (tests, interpreter dry runs) neither has a device to time, so a host clock stands in; those
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
BUSY_REPS = 20  # profiled repetitions of a short call; long calls get MIN_REPS
L2_FLUSH_BYTES = 256 * 1024 * 1024  # as do_bench's cache buffer: more than any GPU's L2
# Under sustained load a GPU runs at its power cap: an H100's SM clock falls from 1980 to about 1500 MHz
# within 0.2 s of a layer's matmuls starting, after which its time per token is flat from 8K to 98K tokens
# (llama3-8b layer, 2.34-2.40 us). A point timed straight after the host's setup gaps instead runs its first
# ~0.2 s at boost clocks: the whole of a small point's repetitions, a fraction of a large one's, so large points
# look slower per token than small ones (the H200 grid's llama3-8b layer took 13% more per token at 64K-128K
# tokens than at 4K-16K without this heat-up, about 5% with it).
HEAT_MS = 300.0


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


def heat(fn: Callable[[], object], sync: Callable[[], object], grad_to_none: list | None = None,
         heat_ms: float = HEAT_MS, clock: Callable[[], float] = time.perf_counter) -> int:
    """Run ``fn`` back-to-back (``sync`` after each call) until ``heat_ms`` have passed on ``clock`` (seconds);
    the calls made."""
    calls, start = 0, clock()
    while calls == 0 or (clock() - start) * 1e3 < heat_ms:
        for x in grad_to_none or ():
            x.grad = None
        fn()
        sync()
        calls += 1
    return calls


def bench_gpu(fn: Callable[[], object], expected_ms: float, grad_to_none: list | None = None) -> Timing:
    """do_bench with the repetition window stretched so that even long calls get MIN_REPS repetitions, after
    :func:`heat`."""
    import torch
    from triton.testing import do_bench

    heat(fn, torch.cuda.synchronize, grad_to_none)
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


def bench_gpu_busy(fn: Callable[[], object], expected_ms: float, grad_to_none: list | None = None) -> Timing:
    """GPU busy time per call: the length of the union of the GPU activities (kernels, copies, fills) that
    run between two marker kernels around each repetition, read from ``torch.profiler``. A union, not a
    sum, because the backward runs its dQ and dK/dV kernels on two streams at once; markers, not the
    launching thread, because the backward launches from autograd's threads. The L2 flush runs outside
    the markers. :func:`heat` first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    reps = int(min(BUSY_REPS, max(MIN_REPS, REP_MS // max(expected_ms, 1e-3))))
    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    heat(fn, torch.cuda.synchronize, grad_to_none)  # also compiles and warms the allocator outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in grad_to_none or ():
                x.grad = None
            cache.zero_()
            torch.cuda._sleep(1)  # marker: the repetition starts
            fn()
            torch.cuda._sleep(1)  # marker: it has ended (after the side stream joins the main one)
        torch.cuda.synchronize()
    busy = busy_ms(gpu_activities(prof))
    if len(busy) != reps or min(busy) <= 0.0:
        raise RuntimeError(f"the profiler's GPU trace holds {len(busy)} of {reps} repetitions "
                           f"(shortest {min(busy, default=0.0):.4f} ms); use --timing events")
    return Timing.of(busy)


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel


def gpu_activities(prof) -> list[tuple[str, int, int]]:
    """``(name, start_ns, end_ns)`` of every GPU activity that the profiler recorded."""
    from torch.autograd import DeviceType

    return [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
            if e.device_type() == DeviceType.CUDA]


def busy_ms(activities: list[tuple[str, int, int]]) -> list[float]:
    """Per pair of markers (start, end): the union length (ms) of the activities that start between them."""
    activities = sorted(activities, key=lambda a: a[1])
    marks = [i for i, a in enumerate(activities) if MARKER in a[0]]
    busy = []
    for start, end in zip(marks[::2], marks[1::2], strict=False):
        total, reach = 0, activities[start][2]
        for _, a, b in activities[start + 1:end]:
            a = max(a, reach)
            if b > a:
                total, reach = total + b - a, b
        busy.append(total / 1e6)
    return busy
