"""Simulated GPU-steps per wall second at 64, 512 and 4096 GPUs, and the time of a policy x layout sweep.

Layouts are dp x cp with cp = 8 (one CP group per node), 8 micro-batches of 2 sequences (default) per DP rank; the
time covers everything a step does: drawing the batch, planning (batching + sparsity policy), costing,
the event loop and the Results rows. Target on the 2-core dev machine: >= 100,000 GPU-steps per CPU-second at
4096 GPUs for every policy (a blind planner's per-step prediction under its belief included); the 7 x 3 x 100 sweep
is timed beside it.

    python -m benchmarks.sim_speed [--policies baseline,lpt,kk] [--steps 20] [--seqs-per-micro-batch 2] [--repeat 3]
                                   [--cp-mode static|dynamic] [--gpus 64,512,4096] [--sweep-steps 100]

``--cp-mode dynamic`` runs the same layouts as dynamic-CP domains: a static policy's plans through the dynamic
engine (sim.cp_groups), a dynamic-CP policy (megatron_dcp) with its own CP groups.
"""
from __future__ import annotations

import time

import pandas as pd

from sparsebalance.sim.core import ArgumentParser, group_options, number_list, one_line_errors
from sparsebalance.sim.config import compose_config
from sparsebalance.sim.run import simulate
from sparsebalance.sim.setup import load_policy

MICRO_BATCHES = 8
TARGET_GPU_STEPS_PER_CPU_S = 100_000  # at TARGET_GPUS, every policy
TARGET_GPUS = 4096


def speed(gpus: int, policy: str, steps: int, seqs_per_micro_batch: int, repeat: int, cp_mode: str = "static") -> dict:
    dp = gpus // 8
    cfg = compose_config([
        f"policy={policy}", f"cluster.nodes={gpus // 8}", "layout.cp=8", f"layout.micro_batches={MICRO_BATCHES}",
        f"workload.global_batch={dp * MICRO_BATCHES * seqs_per_micro_batch}", f"steps={steps}", "write_plans=false",
        f"layout.cp_mode={cp_mode}",
    ])
    # Best of `repeat` runs, and CPU time too: on a shared machine wall time also counts other
    # processes' turns on the cores.
    wall = cpu = float("inf")
    for _ in range(repeat):
        start, cpu_start = time.perf_counter(), time.process_time()
        simulate(cfg)
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - cpu_start)
    return {"gpus": gpus, "layout": f"dp{dp}xcp8", "steps": steps, "wall_s": round(wall, 3),
            "gpu_steps_per_s": round(gpus * steps / wall), "gpu_steps_per_cpu_s": round(gpus * steps / cpu),
            "ms_per_step": round(1e3 * wall / steps, 2)}


def sweep(steps: int) -> tuple[int, float]:
    """Every policy (cycled to 7) x 3 layouts of a 64-GPU cluster, in one process."""
    names = group_options("policy")
    names = [names[i % len(names)] for i in range(7)]
    layouts = [["layout.cp=1"], ["layout.cp=2"], ["layout.cp=4", "layout.pp=2"]]
    start = time.perf_counter()
    for layout in layouts:
        cfg = compose_config(["cluster.nodes=8", "workload.global_batch=256", f"steps={steps}", *layout])
        for name in names:
            simulate(cfg, load_policy(name))
    return len(names) * len(layouts), time.perf_counter() - start


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m benchmarks.sim_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="baseline,lpt,kk", help="comma-separated conf/policy names")
    parser.add_argument("--steps", type=int, default=20)
    # Planning and plan building cost per sequence (Sequence/Assignment objects), so this sets the load.
    parser.add_argument("--seqs-per-micro-batch", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of this many runs")
    parser.add_argument("--cp-mode", choices=("static", "dynamic"), default="static", help="layout.cp_mode of the runs")
    gpus = number_list(int, lambda g: g > 0 and g % 8 == 0, "positive multiples of 8, comma-separated")
    parser.add_argument("--gpus", default="64,512,4096", type=gpus, help="comma-separated cluster sizes")
    parser.add_argument("--sweep-steps", type=int, default=100, help="steps of each sweep job; 0: no sweep")
    args = parser.parse_args(argv)
    sizes = args.gpus
    for name in ("steps", "seqs_per_micro_batch", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.sweep_steps < 0:
        parser.error(f"--sweep-steps {args.sweep_steps}: must be >= 0 (0: no sweep)")
    known = group_options("policy")
    unknown = [p for p in args.policies.split(",") if p not in known]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)}; allowed: {', '.join(known)}")
    per_mb = args.seqs_per_micro_batch
    rows = [
        {"policy": p, **speed(g, p, args.steps, per_mb, args.repeat, args.cp_mode)}
        for p in args.policies.split(",")
        for g in sizes
    ]
    table = pd.DataFrame(rows)
    table["us_per_gpu_step"] = (1e6 / table["gpu_steps_per_s"]).round(2)
    print(f"{MICRO_BATCHES} micro-batches x {per_mb} sequences per DP rank, cp=8, cp_mode={args.cp_mode}")
    print(table.to_string(index=False))
    if TARGET_GPUS not in sizes:
        print(f"the target is set at {TARGET_GPUS} GPUs, which --gpus leaves out: not assessed")
    for row in table[table["gpus"] == TARGET_GPUS].itertuples():
        met = row.gpu_steps_per_cpu_s >= TARGET_GPU_STEPS_PER_CPU_S
        print(f"{row.policy} at {TARGET_GPUS} GPUs: {row.gpu_steps_per_cpu_s:,} GPU-steps per CPU-second against "
              f"the target {TARGET_GPU_STEPS_PER_CPU_S:,}: {'met' if met else 'MISSED'}")
    if args.sweep_steps:
        cpu_start = time.process_time()
        jobs, wall = sweep(steps=args.sweep_steps)
        cpu = time.process_time() - cpu_start
        print(f"sweep: {jobs} jobs (7 policies x 3 layouts) x {args.sweep_steps} steps on 64 GPUs in {wall:.1f} s "
              f"({cpu:.1f} CPU-s)")


if __name__ == "__main__":
    main()
