"""The task's sequences packed into tensors: one (rank, micro-batch) of a Plan, ready for the model.

What a sequence holds comes from ``runner.task`` (numpy, a function of (seed, sequence id)); this module only
turns it into tensors on the run's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from runner.task import BOS, PAD, TaskConfig, make_example
from sim.core import ConfigError
from sim.plan import Assignment


@dataclass
class MicroBatch:
    """One packed micro-batch on one rank, ready for the model."""

    tokens: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [n+1] int32, on the host
    target_positions: torch.Tensor  # [n_answers] indices into the packed stream
    targets: torch.Tensor  # [n_answers]
    p: torch.Tensor  # [n] coverage targets, on the host
    kept_fraction: torch.Tensor | None  # [n] fixed kept fractions, when the policy set them, on the host
    # Under context parallelism (runner.cp.shard_micro_batch): which tokens of the packed micro-batch this
    # rank holds; tokens and target positions are then this rank's, cu_seqlens and budgets the micro-batch's
    shards: object = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def docs(self):
        """What the model takes as its documents: the shards under CP, else cu_seqlens."""
        return self.cu_seqlens if self.shards is None else self.shards


def pack(assignments: tuple[Assignment, ...], truth: Mapping[int, float], task: TaskConfig, vocab_size: int,
         seed: int, device: torch.device) -> MicroBatch:
    """Pack the sequences of one (rank, micro-batch) of a Plan, with their budgets, in plan order; each
    sequence is generated from its sensitivity in ``truth`` (id -> s), which the Plan does not carry."""
    examples = [make_example(task, vocab_size, seed, a.seq_id, a.length, truth[a.seq_id]) for a in assignments]
    offsets = np.cumsum([0] + [a.length for a in assignments])
    tokens = np.concatenate([e.tokens for e in examples])
    positions = np.concatenate([o + e.answer_positions for o, e in zip(offsets, examples)])
    answers = np.concatenate([e.answers for e in examples])
    if any(a.budget.top_k is not None for a in assignments):
        raise ConfigError("a Plan gives top-k budgets (budget.top_k), which the simulator prices but the runner's "
                          "kernel cannot select yet; allowed in the runner: coverage-target (p) and kept-fraction "
                          "budgets (dst family=topp, fixed without top_k)")
    fixed = [a.budget.kept_fraction for a in assignments]
    if any(f is None for f in fixed) and any(f is not None for f in fixed):
        raise ValueError("a micro-batch mixes coverage-target and fixed-kept-fraction budgets")

    def host(x, dtype):
        return torch.as_tensor(np.asarray(x), dtype=dtype)

    def tensor(x, dtype):
        return host(x, dtype).to(device, non_blocking=True)

    # cu_seqlens and the budgets stay on the host: the attention reads their values there (block layout,
    # list sizes), and device copies would cost a device->host sync in every layer
    return MicroBatch(
        tokens=tensor(tokens, torch.long),
        cu_seqlens=host(offsets, torch.int32),
        target_positions=tensor(positions, torch.long),
        targets=tensor(answers, torch.long),
        p=host([a.budget.p for a in assignments], torch.float32),
        kept_fraction=None if fixed[0] is None else host(fixed, torch.float32),
    )


def placeholder(device: torch.device, length: int = 1) -> MicroBatch:
    """A micro-batch of one ``length``-token sequence (one token; under CP one per zigzag chunk) that stands in
    for an empty one (its loss weighs nothing), so that every replica runs the same forwards, backwards and
    collectives."""
    return MicroBatch(
        tokens=torch.full((length,), BOS, device=device),
        cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
        target_positions=torch.tensor([0], device=device),
        targets=torch.tensor([PAD], device=device),
        p=torch.tensor([1.0]),
        kept_fraction=None,
    )


def n_answers(assignments, task: TaskConfig, truth: Mapping[int, float]) -> int:
    """Scored tokens of a set of assignments; every rank computes the global count from the Plan and the data."""
    return sum(task.queries(truth[a.seq_id]) for a in assignments)
