"""Planning overhead of ``sparsebalance``: one 1024-sequence global batch for 128 DP ranks.

``python -m benchmarks.plan_overhead`` prints the median and worst time of one planning step
(``sim.planner.Planner``: the estimator's belief, SAB's plan, DST's tune, the predicted step time, then the
planner observing the step's outcome; the simulated step itself is not timed) per step (16 nodes x 8 H200,
DP128, 4 micro-batches of 2 sequences per rank, the longqa workload) and
whether the median meets the 20 ms target. Both wall and CPU time of this process are printed: the
machine is shared (the load average is printed too), and CPU time is what the planner itself costs.
"""
from __future__ import annotations

import os
import statistics
import time

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

TARGET_MS = 20.0


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.plan_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dp", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--policy", default="sparsebalance",
                        help="a policy of conf/policy/, optionally with overrides: sparsebalance:batching.params.refine=true")
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
    print(f"{args.policy} planning, {args.global_batch} sequences, DP{args.dp} x {micro_batches} micro-batches, "
          f"{len(wall)} steps, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, times in (("wall", wall), ("cpu", cpu)):
        median = statistics.median(times)
        print(f"  {name}: median {median:.2f} ms, worst {max(times):.2f} ms "
              f"(target {TARGET_MS:.0f} ms: {'met' if median < TARGET_MS else 'MISSED'})")


if __name__ == "__main__":
    main()
