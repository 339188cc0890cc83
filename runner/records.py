"""The runner's own rows, beside the simulator's (``sim.results``): ``train.csv`` and ``sequences.csv``.

Checkpoints carry these rows as plain dicts; ``runner.checkpoint`` checks them against these fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TrainRecord:
    """One optimiser step: loss and accuracy over every rank, and the slowest rank's times."""

    step: int
    plan_sha256: str  # every rank's Plan had this digest
    loss: float
    accuracy: float
    answers: int
    compute_ms: float
    wait_ms: float
    allreduce_ms: float
    optimizer_ms: float
    data_ms: float
    # the most GB any rank's CUDA allocator held at any point of the step, the optimiser step included;
    # None on the CPU, which has no such counter (an empty cell in train.csv)
    peak_memory_gb: Optional[float]
    compilations: int  # Triton variants of the sparse kernel compiled during the step, summed over the ranks


@dataclass(frozen=True)
class SequenceRecord:
    """One sequence of one step: its budget and what the kernel kept and covered."""

    step: int
    seq_id: int
    dp_rank: int
    micro_batch: int
    length: int
    sensitivity: float
    p: float
    budget_kept_fraction: Optional[float]
    budget_top_k: Optional[int]  # top-k budgets: blocks per query block (``p`` is then the floor, 1.0: none)
    kept_fraction: float
    coverage: float
