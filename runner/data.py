"""The task's sequences packed into tensors: one (rank, micro-batch) of a Plan, ready for the model.

What a sequence holds comes from ``runner.task`` (numpy, a function of (seed, sequence id)); this module only
turns it into tensors on the run's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from sparsebalance.runner.task import BOS, PAD, TaskConfig, make_example
from sparsebalance.sim.plan import Assignment


@dataclass
class MicroBatch:
    """One packed micro-batch on one rank, ready for the model."""

    tokens: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [n+1] int32, on the host
    target_positions: torch.Tensor  # [n_answers] indices into the packed stream
    targets: torch.Tensor  # [n_answers]
    p: torch.Tensor | None  # [n] coverage targets; with top_k the coverage floors (None: no floor); on the host
    kept_fraction: torch.Tensor | None  # [n] fixed kept fractions, when the policy set them, on the host
    # Under context parallelism (runner.cp.shard_micro_batch): which tokens of the packed micro-batch this
    # rank holds; tokens and target positions are then this rank's, cu_seqlens and budgets the micro-batch's
    shards: object = None
    top_k: torch.Tensor | None = None  # [n] int64 KV blocks per query block, when the policy set them, on the host
    # runner.attention.PeerRun: the peer (dense or sparse) that runs its attention instead of our kernel (None: ours)
    peer: object = None

    @property
    def budgets(self) -> tuple:
        """``(p, kept_fraction, top_k, peer)``: what the model hands its attention (``runner.attention``)."""
        return self.p, self.kept_fraction, self.top_k, self.peer

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
    positions = np.concatenate([o + e.answer_positions for o, e in zip(offsets, examples, strict=True)])
    answers = np.concatenate([e.answers for e in examples])
    fixed = [a.budget.kept_fraction for a in assignments]
    top_k = [a.budget.top_k for a in assignments]
    floors = [a.budget.p_floor for a in assignments]
    families = {"kept_fraction" if f is not None else "top_k" if k is not None else "p"
                for f, k in zip(fixed, top_k, strict=True)}
    if len(families) > 1:
        raise ValueError(f"a micro-batch mixes budget families ({', '.join(sorted(families))}); the kernel takes "
                         "one per call")
    if top_k[0] is not None and len({f is None for f in floors}) > 1:
        raise ValueError("a micro-batch mixes top-k budgets with and without a coverage floor (p_floor)")
    p = [a.budget.p for a in assignments] if top_k[0] is None else floors  # top-k: p is the floor

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
        p=None if p[0] is None else host(p, torch.float32),
        kept_fraction=None if fixed[0] is None else host(fixed, torch.float32),
        top_k=None if top_k[0] is None else host(top_k, torch.int64),
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
