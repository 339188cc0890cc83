"""The library's front door, ``sparsebalance.partition``, against verl's balancer.

``python -m benchmarks.front_door`` prints, with the load average (the machine may be shared):

* import + first call: a fresh interpreter's ``import sparsebalance`` and one ``partition`` (CPU and wall, the
  medians of ``--fresh`` interpreters; the target is on CPU time, as the machine may be shared), and which of
  Hydra, OmegaConf, SimPy, SciPy and pandas it loaded (none should);
* per call: the CPU median of ``partition(lengths, dp=8, micro_batches=m, policy="verl")`` on 64 long-tailed
  lengths, beside the named peer on the same lengths: verl's ``get_seqlen_balanced_partitions(lengths, 8,
  equal_size=True)`` in its strongest form, one bare call on a prepared list. verl is not installed here, so the
  peer is this project's ``sim.balance.ldm_partition``, the same largest differencing method in verl's shape;
  the door adds the input's checks, verl's workload estimate and the cut of each rank into micro-batches;
* ``sim.setup.build_planner("verl")``: wall time of the first call (the configuration's composition included)
  and the median of the next ones, with the configuration stack already imported;

and whether each target is met (TARGETS).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from sparsebalance.sim.core import ArgumentParser, one_line_errors

TARGETS = {"import_first_call_s": 0.5, "call_ms": 1.0, "build_planner_s": 0.2}
HEAVY = ("hydra", "omegaconf", "simpy", "scipy", "pandas")
FRESH = ("import json, sys, time; t, c = time.perf_counter(), time.process_time(); import sparsebalance; "
         "sparsebalance.partition(list(range(1, 65)), dp=8); "
         "print(json.dumps([time.perf_counter() - t, time.process_time() - c, "
         f"[m for m in {HEAVY!r} if m in sys.modules]]))")


def long_tail(n: int, seed: int = 0) -> list[int]:
    """``n`` sequence lengths, most short and a few long (log-normal, 256 to 128K tokens)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(4096), 1.2, size=n), 256, 131072).astype(np.int64).tolist()


def fresh_import(runs: int) -> tuple[float, float, list[str]]:
    """Median wall and CPU seconds of a fresh interpreter's import + first call, and the heavy modules it loaded."""
    wall, cpu, loaded = [], [], set()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, check=True).stdout
        seconds, cpu_seconds, modules = json.loads(out)
        wall.append(seconds)
        cpu.append(cpu_seconds)
        loaded |= set(modules)
    return statistics.median(wall), statistics.median(cpu), sorted(loaded)


def cpu_median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.process_time_ns()
        call()
        times.append((time.process_time_ns() - start) / 1e6)
    return statistics.median(times)


def build_planner_s(calls: int) -> tuple[float, float]:
    from sparsebalance.sim.setup import build_planner

    start = time.perf_counter()
    build_planner("verl")
    first = time.perf_counter() - start
    later = []
    for _ in range(calls):
        start = time.perf_counter()
        build_planner("verl")
        later.append(time.perf_counter() - start)
    return first, statistics.median(later)


def verdict(value: float, target: float, unit: str) -> str:
    return f"target <= {target:g} {unit}: {'met' if value <= target else 'NOT met'}"


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.front_door", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per figure (CPU median)")
    parser.add_argument("--fresh", type=int, default=5, help="fresh interpreters for the import figure")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.fresh < 1:
        parser.error(f"--calls {args.calls} --fresh {args.fresh}: allowed: >= 1 each")
    import sparsebalance
    from sparsebalance.sim.balance import ldm_partition

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    wall, cpu, loaded = fresh_import(args.fresh)
    print(f"import sparsebalance + first partition(): {cpu:.3f} s CPU, {wall:.3f} s wall (medians of {args.fresh} "
          f"fresh interpreters), loaded of {', '.join(HEAVY)}: {loaded or 'none'}; "
          f"{verdict(cpu, TARGETS['import_first_call_s'], 's CPU')}" + ("" if not loaded else ", and NOT light"))
    lengths = long_tail(64)
    peer = cpu_median_ms(lambda: ldm_partition(lengths, 8, True), args.calls)
    for micro_batches in (1, 4):
        ms = cpu_median_ms(lambda m=micro_batches: sparsebalance.partition(lengths, dp=8, micro_batches=m), args.calls)
        print(f"partition(64 lengths, dp=8, micro_batches={micro_batches}, policy='verl'): {ms:.3f} ms CPU per call, "
              f"{ms / peer:.1f}x verl's get_seqlen_balanced_partitions(lengths, 8, equal_size=True) "
              f"({peer:.3f} ms; as sim.balance.ldm_partition, verl's Karmarkar-Karp, since verl is not installed); "
              f"{verdict(ms, TARGETS['call_ms'], 'ms')}")
    first, later = build_planner_s(max(1, min(args.calls, 5)))
    print(f"sim.setup.build_planner('verl'): first {first:.3f} s, then {later:.3f} s wall (median), the "
          f"configuration stack already imported; {verdict(later, TARGETS['build_planner_s'], 's')} (the later "
          "calls; the first composes the configuration)")


if __name__ == "__main__":
    main()
