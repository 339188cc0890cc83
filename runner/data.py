"""Synthetic long-context key-value retrieval, generated locally from (seed, sequence id).

Each Sequence of the workload (its length and sensitivity come from the same generator the simulator
uses) becomes a haystack of random filler with ``n_pairs`` ``KEY k VAL v`` records scattered
uniformly through it, followed by ``n_queries`` ``QUERY k ANS`` prompts at the very end whose answer
``v`` is the next token. Records sit anywhere from the start onwards, so answering needs attention
far back; and the number of records grows with the sequence's sensitivity (more records = attention
mass spread over more blocks = coverage falls faster under sparsity), which ties the simulator's
sensitivity to something that sparsity visibly costs here.

Content depends only on (seed, sequence id), never on rank or step, so any rank can build any
sequence and a resumed run sees exactly the data it would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sim.plan import Assignment

PAD, BOS, KEY, VAL, QUERY, ANS = range(6)
N_SPECIAL = 8
RECORD = 4  # tokens per KEY k VAL v record and per QUERY k ANS v prompt


@dataclass(frozen=True)
class TaskConfig:
    """Vocabulary split and difficulty of the retrieval task."""

    n_keys: int = 64
    n_values: int = 64
    max_pairs: int = 8
    n_queries: int = 2

    def n_pairs(self, sensitivity: float) -> int:
        return 1 + round(min(max(sensitivity, 0.0), 1.0) * (self.max_pairs - 1))

    def queries(self, sensitivity: float) -> int:
        return min(self.n_queries, self.n_pairs(sensitivity))

    def min_vocab(self) -> int:
        return N_SPECIAL + self.n_keys + self.n_values + 1

    def min_length(self, sensitivity: float) -> int:
        return 1 + RECORD * (self.n_pairs(sensitivity) + self.queries(sensitivity))


@dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # [length] int64
    answer_positions: np.ndarray  # positions whose next-token prediction is scored
    answers: np.ndarray  # the value token expected after each answer position


def make_example(task: TaskConfig, vocab_size: int, seed: int, seq_id: int, length: int,
                 sensitivity: float) -> Example:
    if length < task.min_length(sensitivity):
        raise ValueError(
            f"sequence {seq_id} of length {length} is too short for the retrieval task "
            f"(needs {task.min_length(sensitivity)} tokens)"
        )
    rng = np.random.default_rng((seed, seq_id))
    key_base, val_base = N_SPECIAL, N_SPECIAL + task.n_keys
    filler_base = val_base + task.n_values
    tokens = rng.integers(filler_base, vocab_size, size=length, dtype=np.int64)
    tokens[0] = BOS

    n_pairs, n_q = task.n_pairs(sensitivity), task.queries(sensitivity)
    keys = rng.choice(task.n_keys, size=n_pairs, replace=False)
    values = rng.integers(0, task.n_values, size=n_pairs)
    # Records go on a grid of RECORD-token cells over the haystack so that they never overlap.
    haystack_cells = (length - 1 - RECORD * n_q) // RECORD
    cells = np.sort(rng.choice(haystack_cells, size=n_pairs, replace=False))
    for cell, k, v in zip(cells, keys, values):
        at = 1 + cell * RECORD
        tokens[at:at + RECORD] = (KEY, key_base + k, VAL, val_base + v)

    asked = rng.choice(n_pairs, size=n_q, replace=False)
    tail = length - RECORD * n_q
    answer_positions = np.empty(n_q, dtype=np.int64)
    for i, j in enumerate(asked):
        at = tail + i * RECORD
        tokens[at:at + RECORD] = (QUERY, key_base + keys[j], ANS, val_base + values[j])
        answer_positions[i] = at + 2
    return Example(tokens, answer_positions, val_base + values[asked])


@dataclass
class MicroBatch:
    """One packed micro-batch on one rank, ready for the model."""

    tokens: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [n+1] int32, on the host
    target_positions: torch.Tensor  # [n_answers] indices into the packed stream
    targets: torch.Tensor  # [n_answers]
    p: torch.Tensor  # [n] coverage targets, on the host
    kept_fraction: torch.Tensor | None  # [n] fixed kept fractions, when the policy set them, on the host

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def pack(assignments: tuple[Assignment, ...], task: TaskConfig, vocab_size: int, seed: int,
         device: torch.device) -> MicroBatch:
    """Pack the sequences of one (rank, micro-batch) of a Plan, with their budgets, in plan order."""
    examples = [make_example(task, vocab_size, seed, a.seq_id, a.length, a.sensitivity) for a in assignments]
    offsets = np.cumsum([0] + [a.length for a in assignments])
    tokens = np.concatenate([e.tokens for e in examples])
    positions = np.concatenate([o + e.answer_positions for o, e in zip(offsets, examples)])
    answers = np.concatenate([e.answers for e in examples])
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


def placeholder(device: torch.device) -> MicroBatch:
    """A one-token micro-batch that stands in for an empty one (its loss weighs nothing), so that every
    replica runs the same forwards, backwards and collectives."""
    return MicroBatch(
        tokens=torch.tensor([BOS], device=device),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        target_positions=torch.tensor([0], device=device),
        targets=torch.tensor([PAD], device=device),
        p=torch.tensor([1.0]),
        kept_fraction=None,
    )


def n_answers(assignments, task: TaskConfig) -> int:
    """Scored tokens of a set of assignments; every rank computes the global count from the Plan."""
    return sum(task.queries(a.sensitivity) for a in assignments)
