"""Planning overhead of ``sparsebalance``: one 1024-sequence global batch for 128 DP ranks.

``python -m benchmarks.plan_overhead`` prints the median and worst time of one planning step
(``sim.planner.Planner``: the estimator's belief, SAB's plan, DST's tune, the predicted step time, then the
planner observing the step's outcome; the simulated step itself is not timed) per step (16 nodes x 8 H200,
DP128, 4 micro-batches of 2 sequences per rank, the longqa workload) and
whether the CPU median meets the policy's target (TARGET_MS: 10 ms for SparseBalance, 2 ms for verl's balancer),
beside the time of the named peer on the same lengths: verl's ``get_seqlen_balanced_partitions`` as this project
has it (``policies.karmarkar_karp.ldm_partition``, equal counts over the DP ranks). Both wall and CPU time of this
process are printed: the machine is shared (the load average is printed too), and CPU time is what the planner
itself costs.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from sparsebalance.policies.karmarkar_karp import ldm_partition
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.cost import make_cost
from sparsebalance.sim.compare import policy_variant
from sparsebalance.sim.core import ArgumentParser, one_line_errors
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.engine import Engine
from sparsebalance.sim.estimate import make_estimator
from sparsebalance.sim.planner import Planner
from sparsebalance.sim.setup import make_policy
from sparsebalance.sim.workload import Workload, requests, truth_of

TARGET_MS = {"sparsebalance": 10.0, "sparsebalance_topk": 10.0, "verl": 2.0}
DEFAULT_TARGET_MS = 10.0  # any other policy


def peer_ms(batches) -> float:
    """CPU median of ldm_partition (verl's get_seqlen_balanced_partitions) over the same lengths, into the DP
    ranks."""
    times = []
    for batch in batches:
        lengths = np.array([s.length for s in batch], dtype=np.float64)
        start = time.process_time()
        ldm_partition(lengths, 128, True)
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.plan_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dp", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--policy", default="sparsebalance",
                        help="a policy of conf/policy/, optionally with overrides: "
                             "sparsebalance:batching.params.refine=true")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: allowed: >= 2 (the first step, which pays one-off costs, is not timed)")
    if args.dp < 8 or args.dp % 8:
        parser.error(f"--dp {args.dp}: allowed: a positive multiple of 8 (whole nodes of 8 GPUs)")
    if args.global_batch < 2 * args.dp:
        parser.error(f"--global-batch {args.global_batch}: allowed: >= {2 * args.dp} (2 x --dp: one micro-batch "
                     "of 2 sequences per rank)")
    micro_batches = args.global_batch // args.dp // 2
    cfg = compose_config(["workload=longqa", f"workload.global_batch={args.global_batch}",
                          f"cluster.nodes={args.dp // 8}"])
    cluster = Cluster.from_config(cfg.cluster)
    cost = make_cost(cfg.cost, cfg.model, cluster, recompute=cfg.memory.activation_checkpointing)
    layout = Layout(dp=args.dp, micro_batches=micro_batches, gpus=Cluster.gpus(cfg.cluster))
    workload = Workload(cfg.workload, cfg.model.max_context, cfg.seed)
    policy = policy_variant(args.policy, "--policy")
    batches = [workload.batch(step) for step in range(args.steps)]
    engine = Engine(layout, cost, cluster)
    estimator = make_estimator(str(getattr(policy.estimator, "value", policy.estimator)), workload.population,
                               cfg.seed, truth=lambda step: truth_of(batches[step]))
    planner = Planner(*make_policy(policy), estimator, layout, cost, timer=engine)
    wall, cpu = [], []
    for step, batch in enumerate(batches):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = planner.plan(requests(batch), step)
        planning = time.perf_counter() - start, time.process_time() - start_cpu
        outcome = engine.step(plan, truth_of(batch))  # what the step reports, not part of planning
        start, start_cpu = time.perf_counter(), time.process_time()
        planner.observe(plan, outcome.kept, outcome.coverage, outcome.record.step_ms)
        wall.append((planning[0] + time.perf_counter() - start) * 1e3)
        cpu.append((planning[1] + time.process_time() - start_cpu) * 1e3)
    wall, cpu = wall[1:], cpu[1:]  # the first step also pays one-off imports and caches
    target = TARGET_MS.get(args.policy.split(":")[0], DEFAULT_TARGET_MS)
    peer = peer_ms(batches[1:])
    print(f"{args.policy} planning, {args.global_batch} sequences, DP{args.dp} x {micro_batches} micro-batches, "
          f"{len(wall)} steps, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, times in (("wall", wall), ("cpu", cpu)):
        print(f"  {name}: median {statistics.median(times):.2f} ms, worst {max(times):.2f} ms")
    median = statistics.median(cpu)
    print(f"  cpu median {median:.2f} ms against the target {target:g} ms: {'met' if median <= target else 'MISSED'}; "
          f"{median / peer:.1f}x verl's get_seqlen_balanced_partitions (karmarkar_karp.ldm_partition, "
          f"{peer:.2f} ms)")


if __name__ == "__main__":
    main()
