"""Which attention the model calls: the Triton sparse-attention kernel on the GPU, its PyTorch
reference (``kernels.sparse_attention.naive``) on the CPU, both through the pinned API
``sparse_attention(q, k, v, cu_seqlens, p=..., kept_fraction=..., block_size=..., return_selection=True)``;
or ``dense``, plain causal attention per sequence (every block kept), for dense-only runs.

Each returns ``(o, kept_fraction [n], coverage [n])`` from the kernel's selection stats.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

BACKENDS = ("kernel", "naive", "dense")


def make_attention(backend: str, block_size: int):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "dense":
        return dense_attention
    module = importlib.import_module(
        "kernels.sparse_attention" if backend == "kernel" else "kernels.sparse_attention.naive"
    )
    sparse_attention = module.sparse_attention

    def attend(q, k, v, cu_seqlens, budgets):
        p, kept_fraction = budgets
        o, sel = sparse_attention(
            q, k, v, cu_seqlens,
            p=None if kept_fraction is not None else p, kept_fraction=kept_fraction,
            block_size=block_size, return_selection=True,
        )
        return o, sel.kept_fraction, sel.coverage

    return attend


def dense_attention(q, k, v, cu_seqlens, budgets):
    """Causal attention of each packed sequence on its own; refuses sparse budgets rather than
    silently ignoring them."""
    p, kept_fraction = budgets
    if kept_fraction is not None or bool((p < 1).any()):
        raise ValueError("the dense attention backend cannot honour sparse budgets; use 'naive' or 'kernel'")
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        # [L, H, D] -> [H, L, D]; enable_gqa broadcasts the shared KV heads.
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            is_causal=True, enable_gqa=True,
        )
        out[s:e] = o.transpose(0, 1)
    ones = torch.ones(len(bounds) - 1, device=q.device)
    return out, ones, ones
