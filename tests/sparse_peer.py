"""A sparse peer that runs on the CPU, for the tests of sparse peers in the calibration and the runner.

The sparse peers a user runs (FlashAttention-4's block-sparse form) need a GPU; ``NaiveSparse`` stands in for one
with the sparse backends' API (``kernels.backends``: ``select``, then ``attention(..., selection=)``): our
selection, and the blocks it keeps computed by our kernel's PyTorch reference. Tests register it as
``naive_sparse`` for the duration of one test (``monkeypatch.setitem(BACKENDS, NAME, NaiveSparse)``), and
``tests/runner/dense_train.py`` in the runs it starts, so that the registry stays the project's everywhere else.
"""
from __future__ import annotations

from sparsebalance.kernels.backends import cu_seqlens
from sparsebalance.kernels.sparse_attention import VarlenBatch, select_blocks, sparse_attention

NAME = "naive_sparse"


class NaiveSparse:
    name = NAME
    sparse = True
    host_work = False

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size

    def check(self) -> None:
        """Runs wherever torch does."""

    def version(self) -> str:
        return "our selection and kernels.sparse_attention's PyTorch reference (a test's stand-in)"

    def documents(self, lengths, device) -> VarlenBatch:
        return VarlenBatch.from_cu_seqlens(cu_seqlens(lengths))

    def select(self, q, k, docs, **budget):
        return select_blocks(q, k, docs, block_size=self.block_size, **budget)

    def attention(self, q, k, v, docs, selection):
        return sparse_attention(q, k, v, docs, selection=selection, backend="naive")
