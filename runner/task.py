"""Synthetic long-context tasks, generated locally from (seed, sequence id).

Each Sequence of the workload (its length and sensitivity come from the same generator the simulator
uses) becomes a haystack of random filler with ``KEY k VAL v`` records scattered uniformly through it,
followed by up to ``n_queries`` ``QUERY k ANS`` prompts at the very end whose answer is the next token.
Records sit anywhere from the start onwards, so answering needs attention far back; and the number of
records grows with the sequence's sensitivity (more records = attention mass spread over more blocks =
coverage falls faster under sparsity), which ties the simulator's sensitivity to something that
sparsity visibly costs here. Two kinds (``runner.task.kind``):

* ``retrieval``: ``1 + round(s * (max_pairs - 1))`` records with distinct keys; the answer is the value
  of the record whose key is asked: one lookup, one record's block per answer.
* ``multihop``: as many chains of two records, ``KEY a VAL b`` (``b`` a key token) and ``KEY b VAL v``,
  with distinct keys; ``QUERY a`` is answered by ``v``: two lookups, the second keyed by what the first
  read, so each answer needs two records' blocks, placed independently of each other.

Content depends only on (seed, sequence id), never on rank or step, so any rank can build any
sequence and a resumed run sees exactly the data it would have seen. numpy only, no torch: the runner's config
(``runner.config``) holds a ``TaskConfig``, and what reads a run's config (``runner.compare``, ``viz``) runs where
torch is not installed; ``runner.data`` packs the sequences into tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from sparsebalance.sim.config import AT_LEAST_ONE, bounded
from sparsebalance.sim.core import ConfigError

PAD, BOS, KEY, VAL, QUERY, ANS = range(6)
N_SPECIAL = 8
RECORD = 4  # tokens per KEY k VAL v record and per QUERY k ANS v prompt


class TaskKind(str, Enum):
    retrieval = "retrieval"
    multihop = "multihop"


# Records per item a query can ask: a retrieval pair is one record, a multi-hop chain two.
RECORDS_PER_ITEM = {TaskKind.retrieval: 1, TaskKind.multihop: 2}


@dataclass
class TaskConfig:
    """The task (``runner.task``): its kind, vocabulary split and difficulty."""

    kind: TaskKind = TaskKind.retrieval
    n_keys: int = bounded(64, AT_LEAST_ONE)
    n_values: int = bounded(64, AT_LEAST_ONE)
    max_pairs: int = bounded(8, AT_LEAST_ONE)  # items (pairs or chains) of the most sensitive sequence
    n_queries: int = bounded(2, AT_LEAST_ONE)  # at least one scored answer per sequence

    def check(self, prefix: str) -> None:
        per = RECORDS_PER_ITEM[TaskKind(self.kind)]
        if per * self.max_pairs > self.n_keys:
            times = f"{per} * " if per > 1 else ""
            raise ConfigError(
                f"{prefix}max_pairs={self.max_pairs} ({per * self.max_pairs} distinct keys for the {self.name} task) "
                f"exceeds {prefix}n_keys={self.n_keys}; allowed: {times}max_pairs <= n_keys (the records of a "
                "sequence have distinct keys)"
            )

    def check_fits(self, vocab: int, min_len: int, prefix: str) -> None:
        """The model's vocabulary and the workload's shortest sequence hold the task."""
        if vocab < self.min_vocab():
            raise ConfigError(
                f"{prefix}model.vocab={vocab} is too small for the {self.name} task; allowed: >= {self.min_vocab()} "
                "(specials, runner.task.n_keys, n_values and one filler token)"
            )
        if min_len < self.min_length(1.0):
            raise ConfigError(
                f"{prefix}workload.min_len={min_len} is too short for the {self.name} task; allowed: "
                f">= {self.min_length(1.0)} tokens (runner.task.max_pairs items' records and their queries)"
            )

    @property
    def name(self) -> str:
        return TaskKind(self.kind).value

    def n_pairs(self, sensitivity: float) -> int:
        return 1 + round(min(max(sensitivity, 0.0), 1.0) * (self.max_pairs - 1))

    def n_records(self, sensitivity: float) -> int:
        return RECORDS_PER_ITEM[TaskKind(self.kind)] * self.n_pairs(sensitivity)

    def queries(self, sensitivity: float) -> int:
        return min(self.n_queries, self.n_pairs(sensitivity))

    def min_vocab(self) -> int:
        return N_SPECIAL + self.n_keys + self.n_values + 1

    def min_length(self, sensitivity: float) -> int:
        return 1 + RECORD * (self.n_records(sensitivity) + self.queries(sensitivity))


@dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # [length] int64
    answer_positions: np.ndarray  # positions whose next-token prediction is scored
    answers: np.ndarray  # the value token expected after each answer position


def _retrieval(task: TaskConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Records [n, 2] (key, value token; keys in random order) and the askable items [n, 2] (queried key,
    answer token)."""
    key_base, val_base = N_SPECIAL, N_SPECIAL + task.n_keys
    keys = key_base + rng.choice(task.n_keys, size=n, replace=False)
    values = val_base + rng.integers(0, task.n_values, size=n)
    records = np.stack([keys, values], axis=1)
    return records, records


def _multihop(task: TaskConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Chains a -> b -> v: the records (a, b) and (b, v) [2n, 2], in random order (the grid places them in
    this order, so a chain's second record comes before its first as often as after); items (a, v) [n, 2]."""
    key_base, val_base = N_SPECIAL, N_SPECIAL + task.n_keys
    keys = key_base + rng.choice(task.n_keys, size=2 * n, replace=False)
    starts, middles = keys[:n], keys[n:]
    values = val_base + rng.integers(0, task.n_values, size=n)
    records = np.concatenate([np.stack([starts, middles], axis=1), np.stack([middles, values], axis=1)])
    return rng.permutation(records), np.stack([starts, values], axis=1)


ITEMS = {TaskKind.retrieval: _retrieval, TaskKind.multihop: _multihop}


def make_example(task: TaskConfig, vocab_size: int, seed: int, seq_id: int, length: int,
                 sensitivity: float) -> Example:
    if length < task.min_length(sensitivity):
        raise ValueError(
            f"sequence {seq_id} of length {length} is too short for the {task.name} task "
            f"(needs {task.min_length(sensitivity)} tokens)"
        )
    rng = np.random.default_rng((seed, seq_id))
    filler_base = N_SPECIAL + task.n_keys + task.n_values
    tokens = rng.integers(filler_base, vocab_size, size=length, dtype=np.int64)
    tokens[0] = BOS

    n_pairs, n_q = task.n_pairs(sensitivity), task.queries(sensitivity)
    records, items = ITEMS[TaskKind(task.kind)](task, rng, n_pairs)
    # Records go on a grid of RECORD-token cells over the haystack so that they never overlap.
    haystack_cells = (length - 1 - RECORD * n_q) // RECORD
    cells = np.sort(rng.choice(haystack_cells, size=len(records), replace=False))
    for cell, (k, v) in zip(cells, records, strict=True):
        at = 1 + cell * RECORD
        tokens[at:at + RECORD] = (KEY, k, VAL, v)

    asked = rng.choice(n_pairs, size=n_q, replace=False)
    tail = length - RECORD * n_q
    answer_positions = tail + RECORD * np.arange(n_q, dtype=np.int64) + 2
    for at, (k, v) in zip(answer_positions - 2, items[asked], strict=True):
        tokens[at:at + RECORD] = (QUERY, k, ANS, v)
    return Example(tokens, answer_positions, items[asked][:, 1])
