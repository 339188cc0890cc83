"""The attention the model calls: ``kernels.sparse_attention`` through its pinned API, with the Plan's
per-sequence budgets, returning the kernel's selection stats alongside the output.

Backends: ``kernel`` lets the kernel package choose (Triton on CUDA tensors, its PyTorch reference on CPU
tensors, so CPU training never goes through the Triton interpreter); ``triton`` and ``naive`` force one.
"""
from __future__ import annotations

from sparsebalance.kernels.sparse_attention import sparse_attention

BACKENDS = {"kernel": "auto", "triton": "triton", "naive": "naive"}


def budget_keywords(budgets) -> dict:
    """The kernel's budget keywords from a micro-batch's budgets ``(p, kept_fraction[, top_k])``, ``[n]`` host
    tensors or None (``runner.data.MicroBatch.budgets``): the kept fractions where given, else the top-k
    counts with ``p`` as their coverage floor (None: none), else the coverage targets ``p``."""
    p, kept_fraction, top_k = (*budgets, None)[:3]
    if kept_fraction is not None:
        return {"kept_fraction": kept_fraction}
    return {"p": p} if top_k is None else {"top_k": top_k, "p": p}


def make_attention(backend: str, block_size: int):
    """``attend(q, k, v, docs, budgets) -> (o, kept [n], coverage [n])``, ``budgets`` as
    :func:`budget_keywords` takes them; ``docs`` is a ``VarlenBatch`` (built once per micro-batch, so no layer
    reads the offsets again) or a cu_seqlens tensor."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    kernel_backend = BACKENDS[backend]

    def attend(q, k, v, docs, budgets):
        o, sel = sparse_attention(q, k, v, docs, **budget_keywords(budgets), block_size=block_size,
                                  return_selection=True, backend=kernel_backend)
        return o, sel.kept_fraction, sel.coverage

    return attend
