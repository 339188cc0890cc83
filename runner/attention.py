"""The attention the model calls: ``kernels.sparse_attention`` through its pinned API, with the Plan's
per-sequence budgets, returning the kernel's selection stats alongside the output; or, for a micro-batch that
``cost.attention_backend`` puts on a peer (``kernels.backends``: cuDNN, FlashAttention, FlashAttention-4's
block-sparse form), that backend.

Backends of our kernel: ``kernel`` lets the kernel package choose (Triton on CUDA tensors, its PyTorch reference
on CPU tensors, so CPU training never goes through the Triton interpreter); ``triton`` and ``naive`` force one.

Which kernel runs a micro-batch is the cost model's choice (``runner.dense``). A dense peer keeps every causal
block, so its sequences report kept fraction and coverage 1; a sparse peer computes the blocks that our selection
(its ``select``) keeps at the micro-batch's budgets, and its sequences report that selection's stats. This module
needs torch and the kernels only (the calibration's measuring side runs it on machines without Hydra).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsebalance.kernels.sparse_attention import sparse_attention

BACKENDS = {"kernel": "auto", "triton": "triton", "naive": "naive"}


@dataclass(frozen=True)
class PeerRun:
    """A micro-batch's attention on a peer (dense or sparse) instead of our kernel: the loaded backend and its
    documents, built once per micro-batch when it is packed (off the clock, as calibrate.run times the backend)."""

    backend: object  # kernels.backends.AttentionBackend
    docs: object  # backend.documents(lengths, device)
    n_docs: int

    @classmethod
    def of(cls, backend, cu_seqlens: torch.Tensor, device: torch.device) -> PeerRun:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return cls(backend, backend.documents(lengths, device), len(lengths))


def budget_keywords(budgets) -> dict:
    """The kernel's budget keywords from a micro-batch's budgets ``(p, kept_fraction[, top_k[, dense]])``, ``[n]``
    host tensors or None (``runner.data.MicroBatch.budgets``): the kept fractions where given, else the top-k
    counts with ``p`` as their coverage floor (None: none), else the coverage targets ``p``."""
    p, kept_fraction, top_k = (*budgets, None)[:3]
    if kept_fraction is not None:
        return {"kept_fraction": kept_fraction}
    return {"p": p} if top_k is None else {"top_k": top_k, "p": p}


def peer_run(budgets) -> PeerRun | None:
    """The peer a micro-batch's budgets carry (their fourth item), or None: our kernel runs it."""
    return budgets[3] if len(budgets) > 3 else None


def peer_attention(peer: PeerRun, q, k, v, budgets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, kept [n], coverage [n])`` of a micro-batch on ``peer``: a sparse one selects at the budgets first
    (the selection is not differentiated)."""
    backend = peer.backend
    if not backend.sparse:
        every = torch.ones(peer.n_docs, device=q.device)
        return backend.attention(q, k, v, peer.docs), every, every
    with torch.no_grad():
        sel = backend.select(q, k, peer.docs, **budget_keywords(budgets))
    return backend.attention(q, k, v, peer.docs, selection=sel), sel.kept_fraction, sel.coverage


def warm_peers(peers: dict, heads: int, kv_heads: int, head_dim: int, dtype, device) -> dict[str, float]:
    """Each peer's forward and backward once, on two small documents, before the first step: what a peer
    compiles at its first call (FlashAttention-4's kernels: seconds on an H100) would otherwise stall the step
    that first runs it, which under ``hybrid`` may be any. Returns each peer's milliseconds, by name."""
    took = {}
    lengths = [256, 129]  # one document ends mid-block, as training's do
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    draws = torch.Generator(device=device).manual_seed(0)  # the run's own random stream stays untouched
    for name, backend in peers.items():
        start = time.perf_counter()
        q, k, v = (torch.randn(sum(lengths), h, head_dim, device=device, dtype=dtype, generator=draws)
                   .requires_grad_() for h in (heads, kv_heads, kv_heads))
        out, _, _ = peer_attention(PeerRun.of(backend, cu, device), q, k, v, (torch.full((2,), 0.9), None))
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took[name] = (time.perf_counter() - start) * 1e3
    return took


def make_attention(backend: str, block_size: int):
    """``attend(q, k, v, docs, budgets) -> (o, kept [n], coverage [n])``, ``budgets`` as
    :func:`budget_keywords` takes them; ``docs`` is a ``VarlenBatch`` (built once per micro-batch, so no layer
    reads the offsets again) or a cu_seqlens tensor. Where the budgets carry a :class:`PeerRun`, that backend
    runs it: a dense one every causal block (kept fraction and coverage 1), a sparse one the blocks its selection
    keeps at the budgets (that selection's kept fractions and coverages)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    kernel_backend = BACKENDS[backend]

    def attend(q, k, v, docs, budgets):
        peer = peer_run(budgets)
        if peer is not None:
            return peer_attention(peer, q, k, v, budgets)
        o, sel = sparse_attention(q, k, v, docs, **budget_keywords(budgets), block_size=block_size,
                                  return_selection=True, backend=kernel_backend)
        return o, sel.kept_fraction, sel.coverage

    return attend
