"""SimPy engine: one optimiser step of a dp x cp x pp layout under a Plan.

Granularity, chosen so that a step costs O(dp x pp x micro-batches) events, independent of cp and
of the number of sequences:

* one process per (DP rank, pipeline stage); a CP group is folded into it, because its ranks hold
  equal zigzag shards and so are busy for the same time (the CostModel returns per-CP-rank costs
  with the ring KV exchange already overlapped);
* one timeout per forward and per backward of a micro-batch (merged into one per micro-batch when
  pp = 1, where nothing can come between them);
* stages exchange activations/gradients through events that fire a p2p transfer after the sender
  finishes; the stage order is 1F1B (warm-up forwards, steady one-forward-one-backward, cool-down);
  with pp = 1 this is plain gradient accumulation;
* each stage's gradients are all-reduced over its replicas in buckets (``cluster.grad_bucket_mb``, as
  DDP's) while its last backward produces them, taken as produced evenly through that backward; a bucket
  is reduced once every replica has it and the one before it is done (one communication stream). The step
  ends when the last stage's last bucket is reduced; a rank's idle time before the slowest rank finishes
  (pipeline waits included) is the bubble.

All sequence-level work is vectorised with numpy before the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import simpy

from sparsebalance.sim.plan import BudgetArrays, Plan
from sparsebalance.sim.cluster import Cluster, Layout
from sparsebalance.sim.backends import OURS
from sparsebalance.sim.core import ConfigError
from sparsebalance.sim.cost import CostModel, training_flops
from sparsebalance.sim.cp_groups import plan_units, run_units, unit_costs, unit_rows
from sparsebalance.sim.memory import GB, MemoryModel
from sparsebalance.sim.pipeline import last_micro_batches, one_f_one_b, stage_finish_ms
from sparsebalance.sim.results import StepRecord, coverage_fields
from sparsebalance.sim.shapes import ModelShape


@dataclass(frozen=True)
class PlanArrays:
    """A Plan flattened to one numpy row per sequence, with the data's truth about each (its sensitivity)."""

    dp_rank: np.ndarray
    micro_batch: np.ndarray
    length: np.ndarray
    sensitivity: np.ndarray
    budgets: BudgetArrays

    @classmethod
    def from_plan(cls, plan: Plan, truth: Mapping[int, float]) -> PlanArrays:
        """``truth``: sequence id -> sensitivity (sim.workload.truth_of); every planned sequence needs one."""
        ids = plan.seq_ids.tolist()
        missing = [i for i in ids if i not in truth]
        if missing:
            raise ValueError(f"no sensitivity for sequence {missing[0]} of the step {plan.step} plan")
        return cls(plan.dp_ranks, plan.micro_batch_ids, plan.lengths,
                   np.fromiter((truth[i] for i in ids), dtype=np.float64, count=len(ids)), plan.budgets)

    def kept(self, cost: CostModel) -> np.ndarray:
        return self.budgets.kept(cost, self.length, self.sensitivity)


@dataclass(frozen=True)
class Timeline:
    """Event-loop outcome: per (rank, micro-batch, stage) waits and per (rank, stage) finish times."""

    idle_ms: np.ndarray  # [dp, m, pp], barrier wait included (on the last op of the stage)
    finish_ms: np.ndarray  # [dp, pp]
    trace: list[tuple[float, float, int, int, str, int]]  # (start, end, rank, stage, 'F'/'B', mb)


def run_pipeline(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, pp: int, trace: bool = False) -> Timeline:
    """Simulate one step. fwd/bwd: busy ms of a micro-batch, [dp, m] (the same on every stage, as the cost
    model's stages are alike) or [dp, m, pp] (per stage: measured times, runner.replay); p2p: [dp, m] hand-off ms."""
    dp, m = fwd.shape[:2]
    if fwd.ndim == 2:
        fwd, bwd = np.repeat(fwd[..., None], pp, axis=2), np.repeat(bwd[..., None], pp, axis=2)
    env = simpy.Environment()
    idle = np.zeros((dp, m, pp))
    finish = np.zeros((dp, pp))
    events: list = []
    fwd_l, bwd_l, p2p_l = fwd.tolist(), bwd.tolist(), p2p.tolist()

    def send(event: simpy.Event, delay: float) -> None:
        if delay > 0:
            env.timeout(delay).callbacks.append(lambda _: event.succeed())
        else:
            event.succeed()

    def accumulate(rank: int) -> simpy.events.Process:
        # pp = 1: nothing can interrupt a micro-batch between its forward and its backward, so one
        # timeout covers both (half the events; the trace still has both phases at exact times).
        f, b = [t[0] for t in fwd_l[rank]], [t[0] for t in bwd_l[rank]]
        for mb in range(m):
            if trace:
                events.append((env.now, env.now + f[mb], rank, 0, "F", mb))
                events.append((env.now + f[mb], env.now + f[mb] + b[mb], rank, 0, "B", mb))
            yield env.timeout(f[mb] + b[mb])
        finish[rank, 0] = env.now

    def stage_proc(rank: int, stage: int, fwd_in: list, bwd_in: list):
        f, b, hop = fwd_l[rank], bwd_l[rank], p2p_l[rank]
        for is_fwd, mb in one_f_one_b(stage, pp, m):
            waits_on = fwd_in[stage][mb] if is_fwd else bwd_in[stage][mb]
            if waits_on is not None and not waits_on.processed:
                start = env.now
                yield waits_on
                idle[rank, mb, stage] += env.now - start
            busy = f[mb][stage] if is_fwd else b[mb][stage]
            if trace:
                events.append((env.now, env.now + busy, rank, stage, "F" if is_fwd else "B", mb))
            yield env.timeout(busy)
            if is_fwd and stage < pp - 1:
                send(fwd_in[stage + 1][mb], hop[mb])
            elif is_fwd:
                bwd_in[stage][mb].succeed()  # the last stage turns straight around
            elif stage > 0:
                send(bwd_in[stage - 1][mb], hop[mb])
        finish[rank, stage] = env.now

    for rank in range(dp):
        if pp == 1:
            env.process(accumulate(rank))
            continue
        fwd_in = [[None] * m] + [[env.event() for _ in range(m)] for _ in range(pp - 1)]
        bwd_in = [[env.event() for _ in range(m)] for _ in range(pp)]
        for stage in range(pp):
            env.process(stage_proc(rank, stage, fwd_in, bwd_in))
    env.run()

    barrier = finish.max(initial=0.0)
    for stage, mb in enumerate(last_micro_batches(pp, m)):
        idle[:, mb, stage] += barrier - finish[:, stage]
    events.sort()
    return Timeline(idle, finish, events)


@dataclass(frozen=True)
class StepOutcome:
    record: StepRecord
    rows: dict[str, np.ndarray]  # MicroBatchRecord columns
    timeline: Timeline
    kept: np.ndarray  # [n] per sequence in plan order: what the kernel reports
    coverage: np.ndarray  # [n]


class Engine:
    def __init__(self, layout: Layout, cost: CostModel, cluster: Cluster, memory: MemoryModel | None = None) -> None:
        self.layout = layout
        self.cost = cost
        self.cluster = cluster
        self.memory = memory  # None: no memory figures (NaN in the records)
        params = ModelShape.from_config(cost.model).total_params / layout.pp / layout.tp  # one TP rank's share
        self.buckets = cluster.grad_buckets(params)
        self.bucket_ms = cluster.grad_allreduce_ms(params / self.buckets, layout)

    def reduced_ms(self, start: np.ndarray, busy: np.ndarray) -> float:
        """When every stage's gradients are reduced, given each (rank, stage)'s last backward: its start and
        busy ms, [dp, pp]. With B buckets of t ms each, bucket j (of 0..B-1) is ready on a rank at
        start + busy (j+1)/B and done at (j+1) t + max over i <= j of (latest readiness of bucket i - i t);
        the last bucket's end is the larger of the last readiness plus t and the first readiness plus B t."""
        return float(self.reduced_all_ms(start, busy))

    def reduced_all_ms(self, start: np.ndarray, busy: np.ndarray) -> np.ndarray:
        """``reduced_ms`` over leading axes: start and busy [..., dp, pp]."""
        t, b = self.bucket_ms, self.buckets
        last = (start + busy).max(axis=-2) + t
        first = (start + busy / b).max(axis=-2) + b * t
        return np.maximum(last, first).max(axis=-1, initial=0.0)

    def expected_step_ms(self, plan: Plan, kept: np.ndarray) -> float:
        """The mean step time over rows of kept fractions ``kept`` [S, n] (plan order): what a planner that
        believes the sequences will run at one of those rows, each as likely, expects the step to take. The
        same pipeline and gradient reduction as ``step``, in closed form (sim.pipeline)."""
        layout, cost = self.layout, self.cost
        dp, m, pp = layout.dp, layout.micro_batches, layout.pp
        s = kept.shape[0]
        if layout.dynamic:
            units = plan_units(plan, layout)
            costs, p2p = unit_costs(cost, units, np.tile(plan.lengths, s), kept.ravel(), layout, s)
            timeline = run_units(costs.fwd_ms.reshape(s, -1), costs.bwd_ms.reshape(s, -1), p2p[: units.count], units,
                                 layout)
            finish, last = timeline.finish_ms, timeline.last_bwd_ms
            return float(np.maximum(finish.max(axis=(-1, -2)), self.reduced_all_ms(finish - last, last)).mean())
        rows = 1 if (kept == kept[:1]).all() else s  # rows alike (top-k budgets) are priced once
        costs = cost.micro_batch_costs(plan.lengths, kept[:rows], plan.dp_ranks * m + plan.micro_batch_ids, dp * m,
                                       layout)
        fwd = np.broadcast_to(costs.fwd_ms.reshape(rows, dp, m), (s, dp, m))
        bwd = np.broadcast_to(costs.bwd_ms.reshape(rows, dp, m), (s, dp, m))
        p2p = cost.hand_off_ms(costs.tokens[: dp * m], layout).reshape(dp, m)
        finish = stage_finish_ms(fwd, bwd, p2p, pp)  # [S, dp, pp]
        last_bwd = bwd[:, :, last_micro_batches(pp, m)]  # [S, dp, pp]
        step = np.maximum(finish.max(axis=(-1, -2)), self.reduced_all_ms(finish - last_bwd, last_bwd))
        return float(step.mean())

    def exposed_allreduce_ms(self, last_bwd_ms: float) -> float:
        """The reduction's time past the end of compute when every replica's last backward takes this long."""
        t, b = self.bucket_ms, self.buckets
        return max(t, b * t - last_bwd_ms * (1 - 1 / b))

    def step(self, plan: Plan, truth: Mapping[int, float], trace: bool = False,
             busy_ms: tuple[np.ndarray, np.ndarray] | None = None, predicted_ms: float = float("nan"),
             ran: np.ndarray | None = None) -> StepOutcome:
        """One step of ``plan`` on sequences whose sensitivities are ``truth`` (id -> s). ``busy_ms``: (fwd, bwd)
        ms per [dp, m, pp] in place of the cost model's compute times (measured ones, runner.replay); hand-offs,
        the all-reduce, memory and coverage stay modelled. ``predicted_ms``: what the planner expected the step
        to take, recorded beside it. ``ran``: ``[dp, m]`` the backend each micro-batch's attention ran on (a
        run's record, runner.compare) in place of the cost model's choice."""
        layout, cost = self.layout, self.cost
        dp, m, pp = layout.dp, layout.micro_batches, layout.pp
        if layout.dynamic or plan.dynamic_cp:
            if busy_ms is not None or ran is not None or trace:
                raise ConfigError("measured times, measured backends and traces are replayed for static CP only; "
                                  "allowed under layout.cp_mode=dynamic: the modelled step")
            return self.dynamic_step(plan, truth, predicted_ms)
        arrays = PlanArrays.from_plan(plan, truth)
        group = arrays.dp_rank * m + arrays.micro_batch
        kept = arrays.kept(cost)
        mb_cost = cost.micro_batch_costs(arrays.length, kept, group, dp * m, layout,
                                         None if ran is None else np.reshape(ran, dp * m))
        # a micro-batch the cost model runs on a dense backend (cost.attention_backend) keeps every block
        kept = np.where(mb_cost.dense[group], 1.0, kept)
        coverage = cost.coverages(arrays.sensitivity, kept)
        p2p = cost.hand_off_ms(mb_cost.tokens, layout)

        fwd, bwd = busy_ms if busy_ms is not None else (mb_cost.fwd_ms.reshape(dp, m), mb_cost.bwd_ms.reshape(dp, m))
        timeline = run_pipeline(fwd, bwd, p2p.reshape(dp, m), pp, trace)
        barrier = float(timeline.finish_ms.max(initial=0.0))
        last_bwd = np.broadcast_to(bwd.reshape(dp, m, -1), (dp, m, pp))[:, last_micro_batches(pp, m), np.arange(pp)]
        step_ms = max(barrier, self.reduced_ms(timeline.finish_ms - last_bwd, last_bwd))
        tokens = int(arrays.length.sum())
        flops = training_flops(arrays.length, kept, cost.model, cost.block_size)
        # [dp, m, pp] GB of each stage while each micro-batch's backward runs (sim.memory)
        memory_gb = (None if self.memory is None else
                     self.memory.bytes_of(arrays.dp_rank, arrays.micro_batch, arrays.length, kept,
                                          topk=arrays.budgets.fixes_blocks,
                                          on_sparse_peer=np.isin(mb_cost.backend, cost.sparse_backends())) / GB)
        record = StepRecord(
            step=plan.step,
            step_ms=step_ms,
            bubble_fraction=float(timeline.idle_ms.sum() / (dp * pp * barrier)) if barrier > 0 else 0.0,
            tokens_per_s=tokens / step_ms * 1e3 if step_ms > 0 else 0.0,
            mfu=flops / (layout.gpus * self.cluster.peak_tflops * 1e9 * step_ms) if step_ms > 0 else 0.0,
            mean_coverage=float(coverage.mean()) if coverage.size else 1.0,
            min_coverage=float(coverage.min()) if coverage.size else 1.0,
            **coverage_fields(arrays.length, coverage),
            peak_memory_gb=float(memory_gb.max(initial=0.0)) if memory_gb is not None else float("nan"),
            predicted_ms=predicted_ms,
        )
        compute = np.broadcast_to((fwd + bwd).reshape(dp, m, -1), (dp, m, pp)).reshape(-1)
        rows = self._rows(plan.step, group, kept, coverage, mb_cost, compute, p2p, timeline)
        rows["peak_memory_gb"] = memory_gb.reshape(-1) if memory_gb is not None else np.full(rows["step"].size, np.nan)
        return StepOutcome(record, rows, timeline, kept, coverage)

    def dynamic_step(self, plan: Plan, truth: Mapping[int, float], predicted_ms: float = float("nan")) -> StepOutcome:
        """``step`` under dynamic CP (sim.cp_groups): each unit priced on its CP group's size and scheduled on its
        ranks. The records' rows stay per (DP rank, micro-batch, stage), a DP rank standing for its cp ranks of
        the domain: its busiest rank's compute and communication, their mean idle, the most any of them holds."""
        layout, cost = self.layout, self.cost
        m, pp, domain = layout.micro_batches, layout.pp, layout.domain
        arrays = PlanArrays.from_plan(plan, truth)
        units = plan_units(plan, layout)
        kept = arrays.kept(cost)
        costs, p2p = unit_costs(cost, units, arrays.length, kept, layout)
        kept = np.where(costs.dense[units.row_unit], 1.0, kept)
        coverage = cost.coverages(arrays.sensitivity, kept)
        timeline = run_units(costs.fwd_ms[None], costs.bwd_ms[None], p2p, units, layout, idle=True)
        finish, last = timeline.finish_ms[0], timeline.last_bwd_ms[0]
        barrier = float(finish.max(initial=0.0))
        step_ms = max(barrier, self.reduced_ms(finish - last, last))
        memory_gb = (None if self.memory is None else
                     self.memory.unit_bytes(units, arrays.length, kept, arrays.budgets.fixes_blocks,
                                            np.isin(costs.backend, cost.sparse_backends())) / GB)
        tokens = int(arrays.length.sum())
        flops = training_flops(arrays.length, kept, cost.model, cost.block_size)
        record = StepRecord(
            step=plan.step, step_ms=step_ms,
            bubble_fraction=float(timeline.idle_ms.sum() / (domain * pp * barrier)) if barrier > 0 else 0.0,
            tokens_per_s=tokens / step_ms * 1e3 if step_ms > 0 else 0.0,
            mfu=flops / (layout.gpus * self.cluster.peak_tflops * 1e9 * step_ms) if step_ms > 0 else 0.0,
            mean_coverage=float(coverage.mean()) if coverage.size else 1.0,
            min_coverage=float(coverage.min()) if coverage.size else 1.0,
            **coverage_fields(arrays.length, coverage),
            peak_memory_gb=float(memory_gb.max(initial=0.0)) if memory_gb is not None else float("nan"),
            predicted_ms=predicted_ms,
        )
        def by_axis(per_rank, how):
            return getattr(per_rank.reshape(layout.dp, layout.cp, m, -1), how)(axis=1).reshape(-1)

        busy = np.repeat(unit_rows(units, layout, costs.fwd_ms + costs.bwd_ms)[..., None], pp, axis=2)
        hops = np.array([(stage > 0) + (stage < pp - 1) for stage in range(pp)], dtype=np.float64)
        comm = (unit_rows(units, layout, costs.cp_comm_ms + costs.tp_comm_ms)[..., None]
                + unit_rows(units, layout, p2p)[..., None] * hops)
        axis_mb = units.first // layout.cp * m + units.micro_batch  # [U] the (DP rank, micro-batch) of each unit
        rows = self._rows(plan.step, axis_mb[units.row_unit], kept, coverage, None, by_axis(busy, "max"), None,
                          timeline, dynamic=(costs, axis_mb, by_axis(comm, "max"), by_axis(timeline.idle_ms, "mean")))
        rows["peak_memory_gb"] = (by_axis(memory_gb, "max") if memory_gb is not None
                                  else np.full(rows["step"].size, np.nan))
        return StepOutcome(record, rows, Timeline(timeline.idle_ms, finish, []), kept, coverage)

    def _rows(self, step, group, kept, coverage, mb_cost, compute, p2p, timeline,
              dynamic=None) -> dict[str, np.ndarray]:
        """MicroBatchRecord columns, ordered (dp_rank, micro_batch, stage)."""
        dp, m, pp = self.layout.dp, self.layout.micro_batches, self.layout.pp
        n = dp * m
        count = np.bincount(group, minlength=n)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_kept = np.bincount(group, weights=kept, minlength=n) / count
            mean_cov = np.bincount(group, weights=coverage, minlength=n) / count
        # A stage receives activations (forward) and gradients (backward) unless it is first/last.
        hops = np.array([(stage > 0) + (stage < pp - 1) for stage in range(pp)], dtype=np.float64)
        if dynamic is None:
            comm = np.repeat(mb_cost.cp_comm_ms + mb_cost.tp_comm_ms, pp) + np.outer(p2p, hops).ravel()
            idle = timeline.idle_ms.reshape(-1)
            tokens, backend = mb_cost.tokens, mb_cost.backend
        else:  # per unit: its costs, its (DP rank, micro-batch); per row already: communication, idle
            costs, axis_mb, comm, idle = dynamic
            tokens = np.bincount(axis_mb, weights=costs.tokens, minlength=n).astype(np.int64)
            names: list[list[str]] = [[] for _ in range(n)]
            for where, name in zip(axis_mb.tolist(), costs.backend.tolist(), strict=True):
                names[where] += [] if name in names[where] else [name]
            backend = np.array(["+".join(sorted(found)) or OURS for found in names])
        cols = {
            "step": np.full(n * pp, step, dtype=np.int64),
            "dp_rank": np.repeat(np.arange(dp), m * pp),
            "micro_batch": np.tile(np.repeat(np.arange(m), pp), dp),
            "stage": np.tile(np.arange(pp), n),
            "compute_ms": compute,
            "comm_ms": comm,
            "idle_ms": idle,
            "tokens": np.repeat(tokens, pp),
            "kept_fraction": np.repeat(mean_kept, pp),
            "coverage": np.repeat(mean_cov, pp),
            "attention_backend": np.repeat(backend, pp),
        }
        return cols
