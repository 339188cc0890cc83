"""The training loop of one rank: build its stage's micro-batches from the Plan, train, measure, record.

Each rank is one stage of one replica (runner/dist.py). It runs its micro-batches in 1F1B order
(runner/pipeline.py) under DDP or FSDP (runner/parallel.py); the last backward reduces the gradients
over the stage's replicas while it still computes, and the optimiser steps. What the Results record of
a (replica, stage, micro-batch), as the simulator's engine has it:

* ``compute_ms``: its forward and backward on this stage, without waits; the last backward's ends where
  its compute does (when the gradient of the stage's first layer's input is ready);
* ``idle_ms``: blocked receiving its activations or gradients from a neighbouring stage; on the stage's
  last micro-batch also the wait for the slowest replica of the stage, from timestamps: the latest end of
  compute among the replicas minus this one's (no barrier in the step);
* ``comm_ms``: on the last micro-batch, the gradient reduction that outlasts the compute and that wait;
* ``peak_memory_gb``: on CUDA, the most the caching allocator held during its forward or its backward on this
  stage (``torch.cuda.max_memory_allocated``, reset before each of the stage's operations), what sim.memory
  predicts as the stage's memory during that micro-batch's backward; on the CPU empty.

A step's ``peak_memory_gb`` is its largest micro-batch's, as the engine's; ``train.csv`` adds the step's whole
peak (the optimiser step included) and the Triton compilations of the sparse kernel during the step
(``compile_count()`` before and after, summed over the ranks: zero once every variant is compiled).

``step_ms`` is the wall time from the earliest rank's first micro-batch to the latest rank's end of the
optimiser step. Packing a step's micro-batches happens before the clock starts, as a prefetching data
loader would do it.
"""
from __future__ import annotations

import functools
import hashlib
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR

from sparsebalance.kernels.sparse_attention import compile_count
from sparsebalance.model import make_model
from sparsebalance.runner import checkpoint
from sparsebalance.runner.attention import BACKENDS, PeerRun, make_attention, warm_peers
from sparsebalance.runner.config import LRSchedule
from sparsebalance.runner.cp import make_cp_attention, shard_micro_batch
from sparsebalance.runner.cp_kernel import make_cp_kernel_attention
from sparsebalance.runner.data import n_answers, pack, placeholder
from sparsebalance.runner.dist import Comm
from sparsebalance.runner.parallel import Replicated, merge_states
from sparsebalance.runner.pipeline import Clock, Outcome, StageDriver, Work, most
from sparsebalance.runner.records import SequenceRecord, TrainRecord
from sparsebalance.runner.task import TaskConfig
from sparsebalance.sim.cluster import Cluster
from sparsebalance.sim.core import ConfigError, atomic_path
from sparsebalance.sim.cost import training_flops
from sparsebalance.sim.memory import GB
from sparsebalance.sim.progress import with_progress
from sparsebalance.sim.results import FLOAT_FORMAT, MicroBatchRecord, Results, StepRecord, coverage_fields
from sparsebalance.sim.shapes import StageSpan

WRITE_EVERY_S = 10.0  # the longest a run's Results files lag its steps (they are rewritten whole)
# Config keys a checkpoint must agree on to be resumed (steps may grow under a constant LR schedule; paths and
# timeouts may change). The checkpoint records steps too: a decaying schedule's curve spans them.
RESUME_KEYS = ("seed", "policy", "model", "workload", "cost", "cluster", "layout", "steps")
RESUME_RUNNER_KEYS = ("attention", "data_parallel", "lr", "weight_decay", "lr_schedule", "warmup_steps",
                      "min_lr_ratio", "task")


class Trainer:
    def __init__(self, cfg: DictConfig, planner, cluster: Cluster, comm: Comm, device: torch.device,
                 run_dir: Path) -> None:
        self.cfg, self.planner, self.cluster, self.comm = cfg, planner, cluster, comm
        self.device, self.run_dir = device, run_dir
        self.rank = comm.world.rank
        self.layout = planner.layout  # the Plans'; under runner.one_process this process holds all of it
        self.one_process = cfg.runner.one_process
        self.dp_ranks = range(self.layout.dp) if self.one_process else (comm.dp_rank,)  # whose micro-batches run here
        self.task = TaskConfig(**cfg.runner.task)
        self.block_size = planner.cost.block_size
        # The calibrated layer times are bf16; the CPU path is fp32 (no bf16 in the reference kernel).
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = make_model(cfg.model, cfg.seed, StageSpan(comm.stage, comm.layout.pp)).to(device=device, dtype=dtype)
        self.model = Replicated(model, cfg.runner.data_parallel, comm)
        # Fused AdamW takes plain device tensors; FSDP's parameters are DTensors (foreach instead).
        fused = device.type == "cuda" and cfg.runner.data_parallel == "ddp"
        self.optimizer = make_optimizer(self.model.parameters(), cfg, fused=fused)
        # Before a resume: a checkpoint's optimiser state loads into param groups that have the scheduler's key.
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.driver = StageDriver(self.model, comm, self._attention(), dtype, device)
        warmed = warm_peers(planner.peers, cfg.model.heads, cfg.model.kv_heads, cfg.model.head_dim, dtype, device)
        if warmed and self.rank == 0:
            print("attention peers warmed up before step 0:", ", ".join(f"{name} {ms:.0f} ms"
                                                                     for name, ms in warmed.items()))
        self.history = {"steps": [], "micro_batches": [], "plans": [], "train": [], "sequences": []}
        # The history's steps already in the Results files, and its micro-batch rows they hold.
        self._results, self._rows_written = Results(), 0
        self.start_step = 0
        if cfg.runner.resume:
            self._resume(Path(cfg.runner.resume))

    # ------------------------------------------------------------------ loop
    def train(self) -> dict | None:
        """Train the run's steps; on rank 0, the summary (summary.json's) written after the last one."""
        every = self.cfg.runner.checkpoint_every
        latest: dict = {}
        steps = with_progress(range(self.start_step, self.cfg.steps), self.cfg.policy.name, total=self.cfg.steps,
                              initial=self.start_step, enabled=self.rank == 0,
                              status=lambda: f"loss {latest['loss']:.3f}, acc {latest['accuracy']:.2f}")
        written, summary = -math.inf, None
        for step in steps:
            row = self.step(step)
            checkpoint_due = every and ((step + 1) % every == 0 or step + 1 == self.cfg.steps)
            if row:
                latest = row
                # Rewritten whole (atomically, off the clock) after the last step, with every checkpoint and
                # otherwise at most every WRITE_EVERY_S: a run cut short keeps its steps up to then, and a long
                # run does not spend a time that grows with its length rewriting them after every step.
                if step + 1 == self.cfg.steps or checkpoint_due or time.monotonic() - written >= WRITE_EVERY_S:
                    summary = self._write_results()
                    written = time.monotonic()
            if checkpoint_due:
                self._save(step + 1)
        return summary

    def step(self, step: int) -> dict | None:
        plan, truth = self.planner.plan(step)
        backends = self.planner.backends(plan)  # [dp, m]: the kernel of each micro-batch's attention
        t0 = time.perf_counter()
        assigned = {r: [plan.micro_batch(r, mb) for mb in range(self.layout.micro_batches)] for r in self.dp_ranks}
        n_global = n_answers(plan.assignments, self.task, truth)
        # DDP and FSDP average over the replicas (dp x cp ranks: each CP rank scores the answers among its own
        # tokens); this weight turns that into the sum over the global batch.
        weight = self.model.replicas / n_global
        work = {r: [Work(self._pack(a, truth, backends[r, mb]), weight if a else 0.0, empty=not a)
                    for mb, a in enumerate(mine)] for r, mine in assigned.items()}
        data_ms = (time.perf_counter() - t0) * 1e3

        self.comm.sync()
        clock = Clock(self.device)
        compiled = compile_count()
        clock.start()
        with self.comm.guard(f"step {step}"):
            # One process: the replicas one after another, their gradients accumulated (each replica's last
            # backward reduces over a world of one, which leaves them as they are).
            outcomes = {r: self.driver.step(mine, clock) for r, mine in work.items()}
            before_opt = clock.mark()
            self.driver.memory.reset()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            end = clock.mark()
            optimizer_peak = self.driver.memory.peak()
        self.comm.sync()

        shared = dict(start_wall=clock.wall0, end_wall=clock.wall(end), data_ms=data_ms,
                      optimizer_ms=clock.ms(end) - clock.ms(before_opt),
                      plan_sha256=hashlib.sha256(plan.to_json().encode()).hexdigest(),
                      compilations=compile_count() - compiled)
        local = [{**self._local_record(step, plan, assigned[r], outcome, clock, r, truth, backends[r]), **shared,
                  "peak_bytes": most(*outcome.peaks.values(), outcome.tail_peak, optimizer_peak)}
                 for r, outcome in outcomes.items()]
        if self.one_process:
            # Sequential replicas wait for nobody (every one's compute ends with the last one's); the step's
            # compilations are counted once.
            last_end = max(r["compute_end_wall"] for r in local)
            for r in local:
                r["compute_end_wall"] = last_end
            for r in local[1:]:
                r["compilations"] = 0
            gathered = local
        else:
            with self.comm.guard(f"the records of step {step}"):
                gathered = self.comm.gather(local[0])  # on every rank, so every planner observes the same
        self._observe(plan, gathered)
        if self.rank != 0:
            return None
        return self._record_step(step, plan, gathered, n_global)

    def _observe(self, plan, gathered: list[dict]) -> None:
        """What the kernel reported of every sequence (kept fraction and coverage, over layers and stages) and
        how long the step took, shown to the planner before it plans the next step."""
        by_id = {s["seq_id"]: s for s in merge_stages([s for g in gathered for s in g["sequences"]])}
        kept = [by_id[a.seq_id]["kept_fraction"] for a in plan.assignments]
        coverage = [by_id[a.seq_id]["coverage"] for a in plan.assignments]
        step_ms = max(g["end_wall"] for g in gathered) - min(g["start_wall"] for g in gathered)
        self.planner.observe(plan, kept, coverage, step_ms)

    def _attention(self):
        """The kernel through its API; under CP the kernel over all-gathered keys (runner/cp_kernel.py), or
        with ``runner.attention=naive`` the ring of PyTorch pieces (runner/cp.py)."""
        backend = self.cfg.runner.attention
        if self.comm.ring is None:
            return make_attention(backend, self.block_size)
        if backend == "naive":
            return make_cp_attention(self.block_size, self.comm.ring)
        return make_cp_kernel_attention(self.block_size, self.comm.ring, BACKENDS[backend])

    def _pack(self, assignments, truth, backend: str):
        """This rank's share of a micro-batch: all of it, or under CP its zigzag chunks of every sequence; with
        the peer (dense or sparse) that runs its attention where ``backend`` names one
        (runner.attention.PeerRun)."""
        batch = (pack(assignments, truth, self.task, self.cfg.model.vocab, self.cfg.seed, self.device) if assignments
                 else placeholder(self.device, 2 * self.comm.layout.cp))
        if backend in self.planner.peers:
            batch.peer = PeerRun.of(self.planner.peers[backend], batch.cu_seqlens, self.device)
        return batch if self.comm.ring is None else shard_micro_batch(batch, self.comm.layout.cp, self.comm.cp_rank)

    # ------------------------------------------------------------------ records
    def _local_record(self, step, plan, assigned, outcome: Outcome, clock: Clock, dp_rank: int, truth,
                      backends) -> dict:
        """This rank's rows, as plain Python values (gathered to rank 0 as objects). The last micro-batch's
        wait and communication are filled in on rank 0, which sees every replica's end of compute."""
        m = self.layout.micro_batches
        compute, idle = np.zeros(m), np.zeros(m)
        for mb, before, received, after in outcome.ops:
            idle[mb] += clock.ms(received) - clock.ms(before)
            compute[mb] += clock.ms(after) - clock.ms(received)
        last_mb, _, _, last_after = outcome.ops[-1]
        compute_end = clock.ms(outcome.compute_end)
        compute[last_mb] -= clock.ms(last_after) - compute_end  # the reduction after the compute is not compute
        rows, sequences = [], []
        loss_sum, correct = 0.0, 0
        for mb in range(m):
            kept_mb = cov_mb = float("nan")
            if mb in outcome.outputs:
                loss, right, kept, cov = outcome.outputs[mb]
                kept, cov = kept.cpu().tolist(), cov.cpu().tolist()
                kept_mb, cov_mb = float(np.mean(kept)), float(np.mean(cov))
                if loss is not None:
                    loss_sum += float(loss)
                    correct += int(right)
                # Under CP every rank of the replica has the whole sequences' stats; the first one records them.
                for a, k, c in zip(assigned[mb] if self.comm.cp_rank == 0 else (), kept, cov, strict=False):
                    sequences.append(asdict(SequenceRecord(
                        step=step, seq_id=a.seq_id, dp_rank=dp_rank, micro_batch=mb, length=a.length,
                        sensitivity=truth[a.seq_id], p=a.budget.p if a.budget.p_floor is None else a.budget.p_floor,
                        budget_kept_fraction=a.budget.kept_fraction, budget_top_k=a.budget.top_k,
                        kept_fraction=k, coverage=c,
                    )))
            peak = outcome.peaks[mb]
            rows.append(asdict(MicroBatchRecord(
                step=step, dp_rank=dp_rank, micro_batch=mb, stage=self.comm.stage,
                compute_ms=float(compute[mb]) if assigned[mb] else 0.0, comm_ms=0.0, idle_ms=float(idle[mb]),
                tokens=sum(a.length for a in assigned[mb]), kept_fraction=kept_mb, coverage=cov_mb,
                # the field's "not measured" NaN on the CPU: an empty cell in micro_batches.csv
                peak_memory_gb=math.nan if peak is None else peak / GB, attention_backend=str(backends[mb]),
            )))
        return {"rows": rows, "sequences": sequences, "loss_sum": loss_sum, "correct": correct,
                "stage": self.comm.stage, "last_mb": last_mb, "compute_ms": float(compute.sum()),
                "idle_ms": float(idle.sum()), "compute_end_wall": clock.wall(outcome.compute_end),
                "sync_ms": clock.ms(outcome.backward_end) - compute_end}

    def _record_step(self, step, plan, gathered: list[dict], n_global: int) -> dict:
        digests = {g["plan_sha256"] for g in gathered}
        if len(digests) != 1:
            raise RuntimeError(f"step {step}: ranks planned different global batches ({len(digests)} distinct Plans)")
        waits = self._fill_last_micro_batches(gathered)
        rows = merge_cp_ranks([r for g in gathered for r in g["rows"]])
        sequences = merge_stages([s for g in gathered for s in g["sequences"]])
        lengths = np.array([s["length"] for s in sequences])
        kept = np.array([s["kept_fraction"] for s in sequences])
        coverage = np.array([s["coverage"] for s in sequences])
        step_ms = max(g["end_wall"] for g in gathered) - min(g["start_wall"] for g in gathered)
        idle = [g["idle_ms"] + wait for g, wait in zip(gathered, waits, strict=True)]
        busy = max(g["compute_ms"] + i for g, i in zip(gathered, idle, strict=True))
        flops = training_flops(lengths, kept, self.cfg.model, self.block_size)
        peaks = [r["peak_memory_gb"] for g in gathered for r in g["rows"] if not math.isnan(r["peak_memory_gb"])]
        step_peak = most(*(g["peak_bytes"] for g in gathered))
        record = StepRecord(
            step=step,
            step_ms=step_ms,
            bubble_fraction=sum(idle) / (len(gathered) * busy) if busy else 0.0,
            tokens_per_s=float(lengths.sum()) / step_ms * 1e3,
            mfu=flops / (self.layout.gpus * self.cluster.peak_tflops * 1e9 * step_ms),
            mean_coverage=float(coverage.mean()),
            min_coverage=float(coverage.min()),
            peak_memory_gb=max(peaks) if peaks else math.nan,  # as the engine's: the largest micro-batch's
            **coverage_fields(lengths, coverage),
            predicted_ms=self.planner.predicted_ms,
        )
        train = TrainRecord(
            step=step,
            plan_sha256=digests.pop(),
            loss=sum(g["loss_sum"] for g in gathered) / n_global,
            accuracy=sum(g["correct"] for g in gathered) / n_global,
            answers=n_global,
            compute_ms=max(g["compute_ms"] for g in gathered),
            wait_ms=max(idle),
            allreduce_ms=max(r["comm_ms"] for g in gathered for r in g["rows"]),
            optimizer_ms=max(g["optimizer_ms"] for g in gathered),
            data_ms=max(g["data_ms"] for g in gathered),
            peak_memory_gb=None if step_peak is None else step_peak / GB,
            compilations=sum(g["compilations"] for g in gathered),
        )
        h = self.history
        h["steps"].append(asdict(record))
        h["micro_batches"].extend(rows)
        h["plans"].append(plan.to_json())
        row = asdict(train)
        h["train"].append(row)
        h["sequences"].extend(sequences)
        return row

    @staticmethod
    def _fill_last_micro_batches(gathered: list[dict]) -> list[float]:
        """Each rank's wait for the slowest replica of its stage (latest end of compute minus its own) and the
        reduction that outlasted it, on its last micro-batch's row; returns the waits."""
        latest: dict[int, float] = {}
        for g in gathered:
            latest[g["stage"]] = max(latest.get(g["stage"], -np.inf), g["compute_end_wall"])
        waits = []
        for g in gathered:
            wait = latest[g["stage"]] - g["compute_end_wall"]
            last = next(r for r in g["rows"] if r["micro_batch"] == g["last_mb"])
            last.update(idle_ms=last["idle_ms"] + wait, comm_ms=max(0.0, g["sync_ms"] - wait))
            waits.append(wait)
        return waits

    def _write_results(self) -> dict:
        """The simulator's files (sim.results.Results) plus the runner's own: train.csv, sequences.csv; returns the
        summary."""
        h = self.history
        results = self._results
        # Steps recorded since the last write join the Results (rows are appended in step order).
        rows = pd.DataFrame(h["micro_batches"][self._rows_written:])
        for record, plan in zip(h["steps"][len(results.steps):], h["plans"][len(results.steps):], strict=True):
            mine = rows[rows["step"] == record["step"]].sort_values(["dp_rank", "micro_batch", "stage"])
            results.add(StepRecord(**record), {c: mine[c].to_numpy() for c in mine.columns}, plan)
        self._rows_written = len(h["micro_batches"])
        cfg = self.cfg
        summary = results.summary(
            policy=cfg.policy.name, dp=self.layout.dp, cp=self.layout.cp, pp=self.layout.pp,
            micro_batches=self.layout.micro_batches, gpus=self.layout.gpus, seed=cfg.seed,
            model=cfg.model.name, workload=cfg.workload.name, cost=cfg.cost.name,
        )
        train = pd.DataFrame(h["train"])
        tail = train.tail(max(1, len(train) // 4))  # the last quarter: where the run ended up
        summary.update(
            source="runner", one_process=self.one_process, steps_planned=cfg.steps, device=str(self.device),
            attention=cfg.runner.attention,
            final_loss=float(tail["loss"].mean()), final_accuracy=float(tail["accuracy"].mean()),
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_csv_atomic(train, self.run_dir / "train.csv")
        _write_csv_atomic(pd.DataFrame(h["sequences"]), self.run_dir / "sequences.csv")
        results.write(self.run_dir, summary)  # summary.json last: marks the run complete
        return summary

    # ------------------------------------------------------------------ checkpoints
    def _save(self, next_step: int) -> None:
        """Every stage's whole weights and optimiser state (from its first replica), merged on rank 0."""
        with self.comm.guard(f"the checkpoint after step {next_step - 1}"):
            state = self.model.state(self.optimizer)
            states = self.comm.gather_to_first(state if self.comm.first_replica else None)
            rng = self.comm.gather(checkpoint.rng_state())
        if self.rank == 0:
            model_state, optimizer_state = merge_states([s for s in states if s is not None])
            checkpoint.save(self.run_dir / "checkpoint.pt", model_state=model_state, optimizer_state=optimizer_state,
                            next_step=next_step, rng_states=rng, history=self.history,
                            config=resume_config(self.cfg))

    def _resume(self, path: Path) -> None:
        ckpt = checkpoint.load(path, self.comm.world.size, resume_config(self.cfg))
        check_continuation(ckpt, path, self.cfg, self.planner)
        self.model.load(self.optimizer, ckpt["model"], ckpt["optimizer"])
        # The LR curve goes on from the checkpoint's next step, scaling the base LR its param groups restored.
        self.scheduler = make_scheduler(self.optimizer, self.cfg, done_steps=ckpt["next_step"])
        checkpoint.set_rng_state(ckpt["rng"][self.rank])
        self.history = ckpt["history"]
        self.start_step = ckpt["next_step"]


def merge_cp_ranks(rows: list[dict]) -> list[dict]:
    """One row per (dp rank, micro-batch, stage), as the simulator's engine writes them: under CP the cp ranks
    of a replica each run the micro-batch's shards, and its row takes the slowest of them (the most compute,
    idle and exposed communication of any of its ranks); tokens, kept fraction and coverage are the
    micro-batch's, the same on every one of them."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row["dp_rank"], row["micro_batch"], row["stage"])
        if key not in merged:
            merged[key] = dict(row)
            continue
        first = merged[key]
        for column in ("compute_ms", "idle_ms", "comm_ms"):
            first[column] = max(first[column], row[column])
        peaks = [x for x in (first["peak_memory_gb"], row["peak_memory_gb"]) if not math.isnan(x)]
        first["peak_memory_gb"] = max(peaks) if peaks else math.nan
    return list(merged.values())


def merge_stages(sequences: list[dict]) -> list[dict]:
    """One row per sequence, in the order of its first stage's: kept fraction and coverage averaged over the
    stages (each holds as many layers)."""
    by_id: dict[int, list[dict]] = {}
    for row in sequences:
        by_id.setdefault(row["seq_id"], []).append(row)
    return [{**rows[0], "kept_fraction": float(np.mean([r["kept_fraction"] for r in rows])),
             "coverage": float(np.mean([r["coverage"] for r in rows]))} for rows in by_id.values()]


def make_optimizer(params, cfg: DictConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.runner.lr, weight_decay=cfg.runner.weight_decay, fused=fused)


def lr_factor(step: int, schedule: LRSchedule, warmup_steps: int, steps: int, min_lr_ratio: float) -> float:
    """The LR of step ``step`` (from 0) as a share of ``runner.lr``: a linear warmup whose first step has
    1 / warmup_steps and whose last has all of it, then all of it to the end (constant), or a cosine from it
    to ``min_lr_ratio`` at ``steps`` (cosine)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if LRSchedule(schedule) is LRSchedule.constant:
        return 1.0
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, done_steps: int = 0) -> LambdaLR:
    """``runner.lr_schedule`` over the run's steps (``lr_factor``), at step ``done_steps``: a resumed run's
    starts where the checkpoint's stopped, from the base LR (``initial_lr``) of the restored param groups."""
    r = cfg.runner
    factor = functools.partial(lr_factor, schedule=r.lr_schedule, warmup_steps=r.warmup_steps, steps=cfg.steps,
                               min_lr_ratio=r.min_lr_ratio)
    return LambdaLR(optimizer, factor, last_epoch=done_steps - 1)


def resume_config(cfg: DictConfig) -> dict:
    """What a checkpoint records of its run's config and a resumed run must agree on."""
    full = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # plain data: no Enum objects
    return {**{k: full[k] for k in RESUME_KEYS},
            **{f"runner.{k}": full["runner"][k] for k in RESUME_RUNNER_KEYS}}


def check_resume(cfg: DictConfig, planner, world_size: int) -> None:
    """Refuse a checkpoint this run cannot continue before any process group or model exists: the checks of
    ``Trainer._resume`` with a planner of its own."""
    path = Path(cfg.runner.resume)
    ckpt = checkpoint.load(path, world_size, resume_config(cfg))
    check_continuation(ckpt, path, cfg, planner)


def check_continuation(ckpt: dict, path: Path, cfg: DictConfig, planner) -> None:
    """Check that the checkpoint fits the whole model (a meta-device copy: shapes, no memory) and its
    optimiser, and that this run's planner plans the checkpoint's steps as it recorded them, replaying the
    planner over them with what each step reported: policies such as sab and the online estimator carry state
    across steps (a budget EMA, the sensitivities seen), so the resumed run then plans what the uninterrupted
    run would."""
    done = ckpt["next_step"]
    if cfg.steps <= done:
        raise ConfigError(f"steps={cfg.steps}: the checkpoint runner.resume={path} has trained {done} steps "
                          f"already; allowed: steps > {done}")
    check_schedule_steps(ckpt, path, cfg)
    with torch.device("meta"):
        model = make_model(cfg.model, cfg.seed)
    # Fused AdamW takes device parameters only; the state dict's layout does not depend on it. The scheduler
    # adds its key (initial_lr) to the param groups, as the run that wrote the checkpoint had it.
    optimizer = make_optimizer(model.parameters(), cfg, fused=False)
    make_scheduler(optimizer, cfg)
    with checkpoint.naming(path):
        checkpoint.check_compatible(ckpt, model, optimizer)
        history = ckpt["history"]
        for step, recorded in enumerate(history["plans"]):
            plan = planner.plan(step)[0]
            if plan.to_json() != recorded:
                raise checkpoint.Invalid(f"its Plan of step {step} is not the one this config plans; "
                                         "allowed: a checkpoint this config wrote")
            # what the kernel reported of that step, as the run that wrote the checkpoint observed it
            by_id = {s["seq_id"]: s for s in history["sequences"] if s["step"] == step}
            planner.observe(plan, [by_id[a.seq_id]["kept_fraction"] for a in plan.assignments],
                            [by_id[a.seq_id]["coverage"] for a in plan.assignments], history["steps"][step]["step_ms"])


def check_schedule_steps(ckpt: dict, path: Path, cfg: DictConfig) -> None:
    """A decaying LR curve spans the run's steps: a resumed run continues it only with the same steps."""
    planned = ckpt["config"].get("steps")
    schedule = LRSchedule(cfg.runner.lr_schedule)
    if schedule is not LRSchedule.constant and cfg.steps != planned:
        raise ConfigError(f"steps={cfg.steps}: the checkpoint runner.resume={path} decays its LR "
                          f"(runner.lr_schedule={schedule.value}) over steps={planned}; allowed: steps={planned} "
                          "(only a constant schedule's run may grow)")


def _write_csv_atomic(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, float_format=FLOAT_FORMAT)
