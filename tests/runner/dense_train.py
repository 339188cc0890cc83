"""``runner.train`` with a dense attention backend that runs on the CPU, for the tests of
``cost.attention_backend`` in the runner (test_attention_backend.py).

The dense backends a user runs instead of our kernel (cuDNN, FlashAttention) need a GPU; ``Reference`` stands in
for one: dense causal attention per document by the PyTorch reference, registered as ``reference`` only in the
process that runs this file (and by the tests, for the duration of one test), so that the registry stays the
project's everywhere else.
"""
from __future__ import annotations

from sparsebalance.kernels.backends import cu_seqlens, register
from sparsebalance.kernels.sparse_attention import dense_causal_varlen

NAME = "reference"


class Reference:
    name = NAME
    sparse = False

    def check(self) -> None:
        """Runs wherever torch does."""

    def version(self) -> str:
        return "kernels.sparse_attention.dense_causal_varlen (the PyTorch reference, a test's stand-in)"

    def documents(self, lengths, device):
        return cu_seqlens(lengths)

    def attention(self, q, k, v, docs):
        return dense_causal_varlen(q, k, v, docs)


if __name__ == "__main__":
    from sparsebalance.runner import train

    register(NAME)(Reference)
    train.cli()
