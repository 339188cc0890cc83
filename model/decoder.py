"""The decoder, whole or one pipeline stage of it, and the one way to build it (``make_model``).

A pipeline stage holds a contiguous share of the layers (``sim.shapes.StageSpan``: ``layers / pp`` each, as the
simulator splits them), the embedding on the first stage and the final norm and LM head on the last. Parameters
keep the names they have in the whole model (``blocks.<layer>....``), and each is initialised from its own name
and the seed, so that every layout starts from the same weights, and the runner, its replay and its measurements
build the same model. A tied LM head on a last stage that is not the first holds a copy of the embedding, kept
equal by summing the two gradients (runner/parallel.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from sparsebalance.kernels.sparse_attention import VarlenBatch
from sparsebalance.sim.shapes import ModelShape, StageSpan

from .layer import AttentionFn, Block, packed_positions, rope_angles

# run_layer(block, x, rotary, docs, budgets) -> (x, kept [n], coverage [n]): one layer, where the caller runs each
# layer itself (runner.replay: every layer its own kept selection, and its forward recomputed in its backward)
RunLayer = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class ForwardOut:
    logits: Optional[torch.Tensor]  # [n_targets, vocab], only at the requested positions; None before the last stage
    kept_fraction: torch.Tensor  # [n_seqs], mean over the stage's layers
    coverage: torch.Tensor  # [n_seqs], mean over the stage's layers
    hidden: Optional[torch.Tensor] = None  # [T, hidden] for the next stage; None on the last stage


class TinyLlama(nn.Module):
    """A small LLaMA-style decoder, or stage ``stage`` of it, whose matrices hold ``shape.stage_params(stage)``
    parameters."""

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

    def forward(self, tokens, cu_seqlens, budgets, target_positions, attention: AttentionFn | None,
                run_layer: RunLayer | None = None) -> ForwardOut:
        """``tokens`` [T] on the first stage, the previous stage's hidden states [T, hidden] on the others.
        Logits at ``target_positions`` only: the task scores a few answer tokens per sequence, and a full
        ``[T, vocab]`` projection would dominate memory at long context. Each layer runs as
        ``block(x, rotary, docs, budgets, attention)``, or as ``run_layer(block, x, rotary, docs, budgets)``
        where the caller gives one (``attention`` is then unused)."""
        # The documents are read and checked once here, for every layer's attention: one host read of
        # cu_seqlens per micro-batch (a device->host copy where a wrapper moved it to the GPU), not per layer.
        # Under context parallelism ``cu_seqlens`` is the micro-batch's shards (runner.cp.Shards), which know
        # their tokens: this rank's zigzag chunks, at their positions in their whole sequences.
        if isinstance(cu_seqlens, torch.Tensor):
            docs = VarlenBatch.from_cu_seqlens(cu_seqlens)
            positions = packed_positions(docs.cu_seqlens.to(tokens.device, non_blocking=True), tokens.shape[0])
        else:
            docs, positions = cu_seqlens, cu_seqlens.positions().to(tokens.device, non_blocking=True)
        rotary = rope_angles(positions, self.shape.head_dim, self.shape.rope_theta)
        x = self.embed(tokens) if self.stage.first else tokens
        kept_sum = cov_sum = 0.0
        for block in self.blocks.values():
            if run_layer is None:
                x, kept, coverage = block(x, rotary, docs, budgets, attention)
            else:
                x, kept, coverage = run_layer(block, x, rotary, docs, budgets)
            kept_sum = kept_sum + kept.float()
            cov_sum = cov_sum + coverage.float()
        n = len(self.blocks)
        if not self.stage.last:
            return ForwardOut(None, kept_sum / n, cov_sum / n, hidden=x)
        logits = self.lm_head(self.norm(x[target_positions]))
        return ForwardOut(logits.float(), kept_sum / n, cov_sum / n)


def make_model(model, seed: int, stage: StageSpan = StageSpan()) -> TinyLlama:
    """The model of ``model`` (a ``ModelConfig``, a ``ModelShape``, or anything with their attributes), or one
    pipeline stage of it, initialised from ``seed``: how the runner, its replay and its measurements build it."""
    return TinyLlama(ModelShape.from_config(model), stage, seed=seed)
