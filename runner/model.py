"""A small LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU) over packed varlen micro-batches.

Sequences are packed into one ``[T]`` token stream delimited by ``cu_seqlens``; RoPE positions
restart at every sequence, and attention is whatever ``attention`` callable the caller gives
(the sparse-attention kernel on the GPU, its PyTorch reference on the CPU, see runner/attention.py),
called with the per-sequence budgets of the Plan.

A pipeline stage holds a contiguous share of the layers, as the simulator splits them (``layers / pp`` each),
the embedding on the first stage and the final norm and LM head on the last. Parameters keep the names
they have in the whole model (``blocks.<layer>....``), and each is initialised from its own name and the
seed, so that every layout starts from the same weights. A tied LM head on a last stage that is not the
first holds a copy of the embedding, kept equal by summing the two gradients (runner/parallel.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sparsebalance.kernels.sparse_attention import VarlenBatch
from sparsebalance.runner.cp import Shards
from sparsebalance.sim.shapes import ModelShape

# attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], docs, budgets) -> (o [T,Hq,D], kept [n], coverage [n]);
# docs: a kernels.sparse_attention.VarlenBatch (TinyLlama's), a cu_seqlens [n+1] tensor, or under context
# parallelism the micro-batch's runner.cp.Shards (T: this rank's tokens); budgets: (p, kept_fraction[, top_k]),
# [n] host tensors or None (runner.data.MicroBatch.budgets, read by runner.attention.budget_keywords)
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
    """One layer (fused QKV and gate/up projections, torch's RMSNorm); calibration times this class
    (calibrate.measure), so the calibrated layer times describe this model's layers."""

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
        s, t = self.shape, x.shape[0]
        q, k, v = self.wqkv(self.attn_norm(x)).split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
        )
        q = rope(q.view(t, s.heads, s.head_dim), *rotary)
        k = rope(k.view(t, s.kv_heads, s.head_dim), *rotary)
        o, kept, coverage = attention(q, k, v.reshape(t, s.kv_heads, s.head_dim), docs, budgets)
        x = x + self.wo(o.reshape(t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), kept, coverage


@dataclass(frozen=True)
class StageSpan:
    """Which part of the model pipeline stage ``index`` of ``count`` holds."""

    index: int = 0
    count: int = 1

    def layers(self, n_layers: int) -> range:
        if n_layers % self.count:
            raise ValueError(f"{n_layers} layers do not split evenly over {self.count} pipeline stages")
        per = n_layers // self.count
        return range(self.index * per, (self.index + 1) * per)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass
class ForwardOut:
    logits: Optional[torch.Tensor]  # [n_targets, vocab], only at the requested positions; None before the last stage
    kept_fraction: torch.Tensor  # [n_seqs], mean over the stage's layers
    coverage: torch.Tensor  # [n_seqs], mean over the stage's layers
    hidden: Optional[torch.Tensor] = None  # [T, hidden] for the next stage; None on the last stage


class TinyLlama(nn.Module):
    def __init__(self, shape: ModelShape, stage: StageSpan = StageSpan(), seed: int = 0) -> None:
        super().__init__()
        self.shape, self.stage = shape, stage
        if stage.first:
            self.embed = nn.Embedding(shape.vocab, shape.hidden)
        # Keyed by the layer's index in the whole model: names as in an nn.ModuleList of every layer.
        self.blocks = nn.ModuleDict({str(i): Block(shape) for i in stage.layers(shape.layers)})
        if stage.last:
            self.norm = nn.RMSNorm(shape.hidden)
            self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
            if shape.tie_embeddings and stage.first:  # one matrix, as the model's published parameter count has it
                self.lm_head.weight = self.embed.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Matrices N(0, 0.02) from a generator seeded by (seed, parameter name); norms 1. A tied LM head
        draws the embedding's values."""
        for name, param in self.named_parameters(remove_duplicate=False):
            if param.is_meta:  # shapes only (checking a checkpoint)
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name == "lm_head.weight" and self.shape.tie_embeddings:
                name = "embed.weight"
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)

    def forward(self, tokens, cu_seqlens, budgets, target_positions, attention: AttentionFn) -> ForwardOut:
        """``tokens`` [T] on the first stage, the previous stage's hidden states [T, hidden] on the others.
        Logits at ``target_positions`` only: the task scores a few answer tokens per sequence, and a full
        ``[T, vocab]`` projection would dominate memory at long context."""
        # The documents are read and checked once here, for every layer's attention: one host read of
        # cu_seqlens per micro-batch (a device->host copy where a wrapper moved it to the GPU), not per layer.
        # Under context parallelism ``cu_seqlens`` is the micro-batch's runner.cp.Shards: the tokens are this
        # rank's zigzag chunks, at their positions in their whole sequences.
        if isinstance(cu_seqlens, Shards):
            docs, positions = cu_seqlens, cu_seqlens.positions().to(tokens.device, non_blocking=True)
        else:
            docs = VarlenBatch.from_cu_seqlens(cu_seqlens)
            positions = packed_positions(docs.cu_seqlens.to(tokens.device, non_blocking=True), tokens.shape[0])
        rotary = rope_angles(positions, self.shape.head_dim, self.shape.rope_theta)
        x = self.embed(tokens) if self.stage.first else tokens
        kept_sum = cov_sum = 0.0
        for block in self.blocks.values():
            x, kept, coverage = block(x, rotary, docs, budgets, attention)
            kept_sum = kept_sum + kept.float()
            cov_sum = cov_sum + coverage.float()
        n = len(self.blocks)
        if not self.stage.last:
            return ForwardOut(None, kept_sum / n, cov_sum / n, hidden=x)
        logits = self.lm_head(self.norm(x[target_positions]))
        return ForwardOut(logits.float(), kept_sum / n, cov_sum / n)
