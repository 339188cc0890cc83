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

# attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], cu_seqlens [n+1], budgets) -> (o [T,Hq,D], kept [n], coverage [n])
AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the runner needs, named as in ``sim.config.ModelConfig`` (the ``conf/model/`` group)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    max_context: int
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, model) -> ModelShape:
        return cls(**{f: getattr(model, f) for f in
                      ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "max_context")})

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads} (GQA)"
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 activations keep their scale.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own sequence, for a packed stream of ``total`` tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_context: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, H, D]`` by the angles of ``positions [T]`` (half-split convention)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.wq = nn.Linear(shape.hidden, shape.heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * shape.head_dim, shape.hidden, bias=False)

    def forward(self, x, positions, rotary, cu_seqlens, budgets, attention: AttentionFn):
        t = x.shape[0]
        q = rotary(self.wq(x).view(t, self.heads, self.head_dim), positions)
        k = rotary(self.wk(x).view(t, self.kv_heads, self.head_dim), positions)
        v = self.wv(x).view(t, self.kv_heads, self.head_dim)
        o, kept, coverage = attention(q, k, v, cu_seqlens, budgets)
        return self.wo(o.reshape(t, -1)), kept, coverage


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.hidden)
        self.mlp = SwiGLU(shape.hidden, shape.ffn)

    def forward(self, x, positions, rotary, cu_seqlens, budgets, attention):
        a, kept, coverage = self.attn(self.attn_norm(x), positions, rotary, cu_seqlens, budgets, attention)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), kept, coverage


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
        self.rotary = Rotary(shape.head_dim, shape.max_context, shape.rope_theta)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, cu_seqlens, budgets, target_positions, attention: AttentionFn) -> ForwardOut:
        """Logits at ``target_positions`` only: the task scores a few answer tokens per sequence,
        and a full ``[T, vocab]`` projection would dominate memory at long context."""
        positions = packed_positions(cu_seqlens, tokens.shape[0])
        x = self.embed(tokens)
        kept_sum = cov_sum = 0.0
        for block in self.blocks:
            x, kept, coverage = block(x, positions, self.rotary, cu_seqlens, budgets, attention)
            kept_sum = kept_sum + kept.float()
            cov_sum = cov_sum + coverage.float()
        logits = self.lm_head(self.norm(x[target_positions]))
        n = len(self.blocks)
        return ForwardOut(logits.float(), kept_sum / n, cov_sum / n)
