"""The training loop of one rank: build micro-batches from the Plan, train, measure, record.

Timing follows the simulator's step: the micro-batches of a rank run back to back (compute), every rank
then waits at a barrier for the slowest (idle, charged to the last micro-batch as the engine does), the
gradients are all-reduced (comm; the runner records it on the last micro-batch) and the optimiser steps.
``step_ms`` is the wall time of all of that. Packing a step's micro-batches happens before the clock
starts, as a prefetching data loader would do it.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from runner import checkpoint
from runner.attention import make_attention
from runner.data import TaskConfig, n_answers, pack
from runner.dist import Comm
from runner.model import ModelShape, TinyLlama
from runner.records import SequenceRecord, TrainRecord
from sim.cluster import Cluster
from sim.core import ConfigError
from sim.cost import training_flops
from sim.results import FLOAT_FORMAT, MicroBatchRecord, Results, StepRecord

# Config keys a checkpoint must agree on to be resumed (steps may grow; paths and timeouts may change).
RESUME_KEYS = ("seed", "policy", "model", "workload", "cost", "cluster", "layout")
RESUME_RUNNER_KEYS = ("attention", "lr", "weight_decay", "task")


class Stopwatch:
    """Device-side timing on CUDA (events, no host sync inside the step), host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3

    def ms(self) -> float:
        """Read after the step has been synchronised."""
        return self._start.elapsed_time(self._end) if self.cuda else self._ms


class Trainer:
    def __init__(self, cfg: DictConfig, planner, cluster: Cluster, comm: Comm, device: torch.device,
                 run_dir: Path) -> None:
        self.cfg, self.planner, self.cluster, self.comm = cfg, planner, cluster, comm
        self.device, self.run_dir = device, run_dir
        self.rank = comm.world.rank
        self.layout = planner.layout
        self.task = TaskConfig(**cfg.runner.task)
        self.block_size = planner.cost.block_size
        self.attention = make_attention(cfg.runner.attention, self.block_size)
        # The calibrated layer times are bf16; the CPU path is fp32 (no bf16 in the reference kernel).
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.model = make_model(cfg).to(device=device, dtype=dtype)
        self.params = list(self.model.parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)  # every rank all-reduces every gradient, also with no micro-batches
        self.optimizer = make_optimizer(self.params, cfg, fused=device.type == "cuda")
        self.history = {"steps": [], "micro_batches": [], "plans": [], "train": [], "sequences": []}
        self.start_step = 0
        if cfg.runner.resume:
            self._resume(Path(cfg.runner.resume))

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        every = self.cfg.runner.checkpoint_every
        bar = tqdm(range(self.start_step, self.cfg.steps), desc=self.cfg.policy.name,
                   disable=self.rank != 0, initial=self.start_step, total=self.cfg.steps)
        for step in bar:
            summary = self.step(step)
            if summary:
                bar.set_postfix(loss=f"{summary['loss']:.3f}", acc=f"{summary['accuracy']:.2f}")
                # Rewritten every step (atomically, off the clock): a run cut short keeps its steps so far.
                self._write_results()
            if every and ((step + 1) % every == 0 or step + 1 == self.cfg.steps):
                self._save(step + 1)

    def step(self, step: int) -> dict | None:
        plan = self.planner.plan(step)
        m = self.layout.micro_batches
        t0 = time.perf_counter()
        batches = [self._pack(plan.micro_batch(self.rank, mb)) for mb in range(m)]
        data_ms = (time.perf_counter() - t0) * 1e3
        n_global = n_answers(plan.assignments, self.task)

        self.comm.sync()
        t_step = time.perf_counter()
        watches, outputs = [], []
        for mb in batches:
            if mb is None:
                watches.append(None)
                outputs.append(None)
                continue
            watch = Stopwatch(self.device)
            watch.start()
            out = self.model(mb.tokens, mb.cu_seqlens, (mb.p, mb.kept_fraction), mb.target_positions,
                             self.attention)
            loss_sum = F.cross_entropy(out.logits, mb.targets, reduction="sum")
            (loss_sum / n_global).backward()
            watch.stop()
            correct = (out.logits.argmax(-1) == mb.targets).sum()
            watches.append(watch)
            outputs.append((loss_sum.detach(), correct, out.kept_fraction.detach(), out.coverage.detach()))
        wait_ms = self.comm.barrier(f"the gradient all-reduce of step {step}")
        comm_ms = self.comm.all_reduce_grads(self.params)
        t_opt = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.comm.sync()
        t_end = time.perf_counter()

        local = self._local_record(step, plan, batches, watches, outputs, wait_ms, comm_ms)
        local.update(step_ms=(t_end - t_step) * 1e3, optimizer_ms=(t_end - t_opt) * 1e3, data_ms=data_ms,
                     plan_sha256=hashlib.sha256(plan.to_json().encode()).hexdigest())
        gathered = self.comm.gather(local)
        if self.rank != 0:
            return None
        return self._record_step(step, plan, gathered, n_global)

    def _pack(self, assignments):
        if not assignments:
            return None
        return pack(assignments, self.task, self.cfg.model.vocab, self.cfg.seed, self.device)

    # ------------------------------------------------------------------ records
    def _local_record(self, step, plan, batches, watches, outputs, wait_ms, comm_ms) -> dict:
        """This rank's rows, as plain Python values (gathered to rank 0 as objects)."""
        m = self.layout.micro_batches
        rows, sequences = [], []
        loss_sum, correct, compute_ms = 0.0, 0, 0.0
        for mb, (batch, watch, out) in enumerate(zip(batches, watches, outputs)):
            last = mb == m - 1
            if batch is None:
                kept_mb = cov_mb = math.nan
                ms = 0.0
            else:
                loss, right, kept, cov = out
                kept, cov = kept.cpu().tolist(), cov.cpu().tolist()
                kept_mb, cov_mb = float(np.mean(kept)), float(np.mean(cov))
                ms = watch.ms()
                loss_sum += float(loss)
                correct += int(right)
                for a, k, c in zip(plan.micro_batch(self.rank, mb), kept, cov):
                    sequences.append(asdict(SequenceRecord(
                        step=step, seq_id=a.seq_id, dp_rank=self.rank, micro_batch=mb, length=a.length,
                        sensitivity=a.sensitivity, p=a.budget.p, budget_kept_fraction=a.budget.kept_fraction,
                        kept_fraction=k, coverage=c,
                    )))
            compute_ms += ms
            rows.append(asdict(MicroBatchRecord(
                step=step, dp_rank=self.rank, micro_batch=mb, stage=0, compute_ms=ms,
                comm_ms=comm_ms if last else 0.0, idle_ms=wait_ms if last else 0.0,
                tokens=0 if batch is None else batch.n_tokens, kept_fraction=kept_mb, coverage=cov_mb,
            )))
        return {"rows": rows, "sequences": sequences, "loss_sum": loss_sum, "correct": correct,
                "compute_ms": compute_ms, "wait_ms": wait_ms, "comm_ms": comm_ms}

    def _record_step(self, step, plan, gathered: list[dict], n_global: int) -> dict:
        digests = {g["plan_sha256"] for g in gathered}
        if len(digests) != 1:
            raise RuntimeError(f"step {step}: ranks planned different global batches ({len(digests)} distinct Plans)")
        sequences = [s for g in gathered for s in g["sequences"]]
        lengths = np.array([s["length"] for s in sequences])
        kept = np.array([s["kept_fraction"] for s in sequences])
        coverage = np.array([s["coverage"] for s in sequences])
        step_ms = max(g["step_ms"] for g in gathered)
        barrier = max(g["compute_ms"] + g["wait_ms"] for g in gathered)
        flops = training_flops(lengths, kept, self.cfg.model, self.block_size)
        record = StepRecord(
            step=step,
            step_ms=step_ms,
            bubble_fraction=sum(g["wait_ms"] for g in gathered) / (self.layout.dp * barrier) if barrier else 0.0,
            tokens_per_s=float(lengths.sum()) / step_ms * 1e3,
            mfu=flops / (self.layout.gpus * self.cluster.peak_tflops * 1e9 * step_ms),
            mean_coverage=float(coverage.mean()),
            min_coverage=float(coverage.min()),
        )
        train = TrainRecord(
            step=step,
            plan_sha256=digests.pop(),
            loss=sum(g["loss_sum"] for g in gathered) / n_global,
            accuracy=sum(g["correct"] for g in gathered) / n_global,
            answers=n_global,
            compute_ms=max(g["compute_ms"] for g in gathered),
            wait_ms=max(g["wait_ms"] for g in gathered),
            allreduce_ms=max(g["comm_ms"] for g in gathered),
            optimizer_ms=max(g["optimizer_ms"] for g in gathered),
            data_ms=max(g["data_ms"] for g in gathered),
        )
        h = self.history
        h["steps"].append(asdict(record))
        h["micro_batches"].extend(r for g in gathered for r in g["rows"])
        h["plans"].append(plan.to_json())
        row = asdict(train)
        h["train"].append(row)
        h["sequences"].extend(sequences)
        return row

    def _write_results(self) -> None:
        """The simulator's files (sim.results.Results) plus the runner's own: train.csv, sequences.csv."""
        h = self.history
        results = Results()
        rows = pd.DataFrame(h["micro_batches"])
        for record, plan in zip(h["steps"], h["plans"]):
            mine = rows[rows["step"] == record["step"]].sort_values(["dp_rank", "micro_batch", "stage"])
            results.add(StepRecord(**record), {c: mine[c].to_numpy() for c in mine.columns}, plan)
        cfg = self.cfg
        summary = results.summary(
            policy=cfg.policy.name, dp=self.layout.dp, cp=self.layout.cp, pp=self.layout.pp,
            micro_batches=self.layout.micro_batches, gpus=self.layout.gpus, seed=cfg.seed,
            model=cfg.model.name, workload=cfg.workload.name, cost=cfg.cost.name,
        )
        train = pd.DataFrame(h["train"])
        tail = train.tail(max(1, len(train) // 4))  # the last quarter: where the run ended up
        summary.update(
            source="runner", steps_planned=cfg.steps, device=str(self.device), attention=cfg.runner.attention,
            final_loss=float(tail["loss"].mean()), final_accuracy=float(tail["accuracy"].mean()),
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_csv_atomic(train, self.run_dir / "train.csv")
        _write_csv_atomic(pd.DataFrame(h["sequences"]), self.run_dir / "sequences.csv")
        results.write(self.run_dir, summary)  # summary.json last: marks the run complete

    # ------------------------------------------------------------------ checkpoints
    def _save(self, next_step: int) -> None:
        states = self.comm.gather(checkpoint.rng_state())
        if self.rank == 0:
            checkpoint.save(self.run_dir / "checkpoint.pt", model=self.model, optimizer=self.optimizer,
                            next_step=next_step, rng_states=states, history=self.history,
                            config=resume_config(self.cfg))

    def _resume(self, path: Path) -> None:
        ckpt = checkpoint.load(path, self.comm.world.size, resume_config(self.cfg))
        check_continuation(ckpt, path, self.model, self.optimizer, self.planner, self.cfg.steps)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        checkpoint.set_rng_state(ckpt["rng"][self.rank])
        self.history = ckpt["history"]
        self.start_step = ckpt["next_step"]


def make_model(cfg: DictConfig) -> TinyLlama:
    return TinyLlama(ModelShape.from_config(cfg.model))


def make_optimizer(params, cfg: DictConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.runner.lr, weight_decay=cfg.runner.weight_decay, fused=fused)


def resume_config(cfg: DictConfig) -> dict:
    """What a checkpoint records of its run's config and a resumed run must agree on."""
    full = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # plain data: no Enum objects
    return {**{k: full[k] for k in RESUME_KEYS},
            **{f"runner.{k}": full["runner"][k] for k in RESUME_RUNNER_KEYS}}


def check_resume(cfg: DictConfig, planner, world_size: int) -> None:
    """Refuse a checkpoint this run cannot continue before any process group or model exists: the
    checks of ``Trainer._resume`` on a meta-device copy of the model (shapes, no memory) and a planner
    of its own."""
    path = Path(cfg.runner.resume)
    ckpt = checkpoint.load(path, world_size, resume_config(cfg))
    with torch.device("meta"):
        model = make_model(cfg)
    # Fused AdamW takes device parameters only; the state dict's layout does not depend on it.
    check_continuation(ckpt, path, model, make_optimizer(model.parameters(), cfg, fused=False), planner, cfg.steps)


def check_continuation(ckpt: dict, path: Path, model, optimizer, planner, steps: int) -> None:
    """Check that the checkpoint fits the model and optimiser and that this run's planner plans the
    checkpoint's steps as it recorded them, replaying the planner over them: policies such as sab carry
    state across steps (a budget EMA), so the resumed run then plans what the uninterrupted run would."""
    done = ckpt["next_step"]
    if steps <= done:
        raise ConfigError(f"steps={steps}: the checkpoint runner.resume={path} has trained {done} steps already; "
                          f"allowed: steps > {done}")
    with checkpoint.naming(path):
        checkpoint.check_compatible(ckpt, model, optimizer)
        for step, recorded in enumerate(ckpt["history"]["plans"]):
            if planner.plan(step).to_json() != recorded:
                raise checkpoint.Invalid(f"its Plan of step {step} is not the one this config plans; "
                                         "allowed: a checkpoint this config wrote")


def _write_csv_atomic(frame: pd.DataFrame, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    frame.to_csv(tmp, index=False, float_format=FLOAT_FORMAT)
    os.replace(tmp, path)
