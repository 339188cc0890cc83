"""A small LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU) over packed varlen micro-batches.

Sequences are packed into one ``[T]`` token stream delimited by ``cu_seqlens``; RoPE positions
restart at every sequence, and attention is whatever ``attention`` callable the caller gives
(the sparse-attention kernel on the GPU, its PyTorch reference on the CPU, see runner/attention.py),
called with the per-sequence budgets of the Plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sim.shapes import ModelShape

# attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], cu_seqlens [n+1], budgets) -> (o [T,Hq,D], kept [n], coverage [n])
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
    """One layer, built like ``calibrate.layer.Layer`` (fused QKV and gate/up projections, torch's
    RMSNorm) so that the calibrated layer times describe this model's layers."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        s = self.shape = shape
        self.attn_norm = nn.RMSNorm(s.hidden)
        self.wqkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(s.hidden)
        self.w13 = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x, rotary, cu_seqlens, budgets, attention: AttentionFn):
        s, t = self.shape, x.shape[0]
        q, k, v = self.wqkv(self.attn_norm(x)).split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
        )
        q = rope(q.view(t, s.heads, s.head_dim), *rotary)
        k = rope(k.view(t, s.kv_heads, s.head_dim), *rotary)
        o, kept, coverage = attention(q, k, v.reshape(t, s.kv_heads, s.head_dim), cu_seqlens, budgets)
        x = x + self.wo(o.reshape(t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), kept, coverage


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [n_targets, vocab], only at the requested positions
    kept_fraction: torch.Tensor  # [n_seqs], mean over layers
    coverage: torch.Tensor  # [n_seqs], mean over layers


class TinyLlama(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.apply(self._init)
        if shape.tie_embeddings:  # one matrix, as the model's published parameter count has it
            self.lm_head.weight = self.embed.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, cu_seqlens, budgets, target_positions, attention: AttentionFn) -> ForwardOut:
        """Logits at ``target_positions`` only: the task scores a few answer tokens per sequence,
        and a full ``[T, vocab]`` projection would dominate memory at long context."""
        # cu_seqlens comes from the host (runner/data.py); the positions are needed on the tokens' device
        positions = packed_positions(cu_seqlens.to(tokens.device, non_blocking=True), tokens.shape[0])
        rotary = rope_angles(positions, self.shape.head_dim, self.shape.rope_theta)
        x = self.embed(tokens)
        kept_sum = cov_sum = 0.0
        for block in self.blocks:
            x, kept, coverage = block(x, rotary, cu_seqlens, budgets, attention)
            kept_sum = kept_sum + kept.float()
            cov_sum = cov_sum + coverage.float()
        logits = self.lm_head(self.norm(x[target_positions]))
        n = len(self.blocks)
        return ForwardOut(logits.float(), kept_sum / n, cov_sum / n)
