"""One decoder layer (RMSNorm, RoPE, GQA, SwiGLU) over a packed varlen token stream, and the positions and
rotary tables that every layer of a forward shares.

Sequences are packed into one ``[T]`` token stream delimited by ``cu_seqlens``; RoPE positions restart at every
sequence, and attention is whatever ``attention`` callable the caller gives (the sparse-attention kernel on the
GPU, its PyTorch reference on the CPU), called with the per-sequence budgets of the Plan. Calibration times this
layer (``calibrate.measure``, ``calibrate.memory``), so the calibrated layer times describe the model's layers.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsebalance.sim.shapes import ModelShape

# attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], docs, budgets) -> (o [T,Hq,D], kept [n], coverage [n]);
# docs: a kernels.sparse_attention.VarlenBatch (the decoder's), a cu_seqlens [n+1] tensor, or under context
# parallelism the micro-batch's shards (runner.cp.Shards; T: this rank's tokens); budgets: (p, kept_fraction[,
# top_k]), [n] host tensors or None (runner.data.MicroBatch.budgets, read by runner.attention.budget_keywords)
AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own sequence, for a packed stream of ``total`` tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, 1, D/2], computed once per forward and shared by every layer."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None, None] * inv
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Block(nn.Module):
    """One layer (fused QKV and gate/up projections, torch's RMSNorm); its matrices hold
    ``ModelShape.params_per_layer`` parameters. Under tensor parallelism (``tp`` > 1, runner.tensor_parallel)
    the projections return this rank's heads and FFN columns, and ``x`` is its share of the tokens."""

    tp = 1  # the tensor-parallel ranks sharing each projection

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        s = self.shape = shape
        self.attn_norm = nn.RMSNorm(s.hidden)
        self.wqkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(s.hidden)
        self.w13 = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x, rotary, docs, budgets, attention: AttentionFn):
        s = self.shape
        heads, kv_heads = s.heads // self.tp, s.kv_heads // self.tp
        qkv = self.wqkv(self.attn_norm(x))
        t = qkv.shape[0]  # every token of the micro-batch (x holds a 1/tp share of them under tensor parallelism)
        q, k, v = qkv.split([heads * s.head_dim, kv_heads * s.head_dim, kv_heads * s.head_dim], -1)
        q = rope(q.view(t, heads, s.head_dim), *rotary)
        k = rope(k.view(t, kv_heads, s.head_dim), *rotary)
        o, kept, coverage = attention(q, k, v.reshape(t, kv_heads, s.head_dim), docs, budgets)
        x = x + self.wo(o.reshape(t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), kept, coverage
