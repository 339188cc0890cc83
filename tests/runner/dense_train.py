"""``runner.train`` with a dense attention backend and a sparse peer that run on the CPU, for the tests of
``cost.attention_backend`` in the runner (test_attention_backend.py).

The dense backends a user runs instead of our kernel (cuDNN, FlashAttention) need a GPU; ``Reference`` stands in
for one: dense causal attention per document by the PyTorch reference, registered as ``reference`` only in the
process that runs this file (and by the tests, for the duration of one test), so that the registry stays the
project's everywhere else; the sparse peer is ``naive_sparse`` (tests/sparse_peer.py), registered alike.
"""
from __future__ import annotations

from sparsebalance.kernels.backends import cu_seqlens, register
from sparsebalance.kernels.sparse_attention import dense_causal_varlen

NAME = "reference"


class Reference:
    name = NAME
    sparse = False
    host_work = False

    def check(self) -> None:
        """Runs wherever torch does."""

    def version(self) -> str:
        return "kernels.sparse_attention.dense_causal_varlen (the PyTorch reference, a test's stand-in)"

    def documents(self, lengths, device):
        return cu_seqlens(lengths)

    def attention(self, q, k, v, docs):
        return dense_causal_varlen(q, k, v, docs)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    from sparsebalance.runner import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where sparse_peer.py is
    from sparse_peer import NAME as SPARSE, NaiveSparse

    register(NAME)(Reference)
    register(SPARSE)(NaiveSparse)
    train.cli()
