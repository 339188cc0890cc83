"""Tensor parallelism with sequence parallelism over the ranks of a 1-D ``DeviceMesh``, through
``torch.distributed.tensor.parallel`` (Megatron-LM's split, as ``sim.tensor_parallel`` prices it).

Each layer of a model (``model.Block``) is parallelised with ``parallelize_module``: the two norms with
``SequenceParallel`` (each rank normalises its share of the tokens), the fused QKV and gate/up projections with
``ColwiseParallel`` from token-sharded inputs (DTensor all-gathers the tokens and each rank computes its heads and
FFN columns), the attention output and down projections with ``RowwiseParallel`` into token-sharded outputs
(DTensor reduce-scatters them). So per layer and direction two all-gathers and two reduce-scatters run, and the
residual stream between them is a DTensor sharded along the tokens (``Shard(0)``; uneven where the micro-batch's
tokens do not divide by tp, which DTensor pads for its collectives).

The fused projections' rows are reordered once, before they are sharded (``fused_rows``), so that each rank's
``Shard(0)`` chunk holds whole heads (its query heads, then its KV heads' keys, then their values) and matching
gate and up columns; ``unfused`` maps a whole tensor (a gradient, a weight) back to the model's own order.

The embedding, the final norm and the LM head stay whole on every rank: the embedding's output is redistributed
to the token shards before the first layer, and the last layer's output to every rank (a DTensor redistribute, whose
backward is the matching one), so every rank computes the same loss and the same gradients of those weights.
Each rank's attention sees its heads only, so the kernel's per-sequence kept fraction and coverage (means over the
heads) are averaged over the tp ranks.
"""
from __future__ import annotations

import torch
from sparsebalance.model import TinyLlama
from sparsebalance.model.layer import AttentionFn, Block
from sparsebalance.sim.shapes import ModelShape
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TOKENS = Shard(0)  # the packed stream's token dimension


def layer_plan() -> dict:
    """One layer's TP with sequence parallelism: what ``parallelize_module`` applies to each ``model.Block``."""
    return {
        "attn_norm": SequenceParallel(sequence_dim=0),
        "wqkv": ColwiseParallel(input_layouts=TOKENS),
        "wo": RowwiseParallel(output_layouts=TOKENS, use_local_output=False),
        "mlp_norm": SequenceParallel(sequence_dim=0),
        "w13": ColwiseParallel(input_layouts=TOKENS),
        "w2": RowwiseParallel(output_layouts=TOKENS, use_local_output=False),
    }


def _chunks(starts_and_widths: list[tuple[int, int]], tp: int) -> torch.Tensor:
    """Rows of the fused matrix, rank after rank: each rank's 1/tp of every part (start, width)."""
    rows = [torch.arange(start + r * width // tp, start + (r + 1) * width // tp)
            for r in range(tp) for start, width in starts_and_widths]
    return torch.cat(rows)


def fused_rows(shape: ModelShape, tp: int) -> dict[str, torch.Tensor]:
    """Per fused projection, the row order whose tp equal chunks are the ranks' shares: ``weight[rows]``."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"wqkv": _chunks([(0, q), (q, kv), (q + kv, kv)], tp),
            "w13": _chunks([(0, shape.ffn), (shape.ffn, shape.ffn)], tp)}


def unfused(name: str, whole: torch.Tensor, shape: ModelShape, tp: int) -> torch.Tensor:
    """A whole parameter-shaped tensor of the TP model (``name`` as in the model) in the model's own row order."""
    for projection, rows in fused_rows(shape, tp).items():
        if name.endswith(f"{projection}.weight"):
            out = torch.empty_like(whole)
            out[rows] = whole
            return out
    return whole


@torch.no_grad()
def parallelize(model: TinyLlama, mesh: DeviceMesh) -> TinyLlama:
    """``model``'s layers split over the ranks of ``mesh`` (every rank holds the same whole model before)."""
    tp = mesh.size()
    rows = fused_rows(model.shape, tp)
    for block in model.blocks.values():
        for name, order in rows.items():
            weight = getattr(block, name).weight
            weight.copy_(weight[order])
        parallelize_module(block, mesh, layer_plan())
        block.tp = tp
    return model


class TensorParallelLayers:
    """``run_layer`` for ``TinyLlama.forward``: each layer on this rank's token share and heads."""

    def __init__(self, model: TinyLlama, mesh: DeviceMesh, attention: AttentionFn) -> None:
        self.mesh, self.attention = mesh, attention
        self.last = list(model.blocks.values())[-1]

    def __call__(self, block: Block, x, rotary, docs, budgets):
        if not isinstance(x, DTensor):  # the first layer: the embedding's (or the previous stage's) whole output
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [TOKENS])
        x, kept, coverage = block(x, rotary, docs, budgets, self.attention)
        if block is self.last:
            x = x.redistribute(self.mesh, [Replicate()]).to_local()
        return x, self._mean(kept), self._mean(coverage)

    def _mean(self, stats: torch.Tensor) -> torch.Tensor:
        """The mean over the tp ranks of a per-sequence statistic of this rank's heads."""
        with torch.no_grad():
            total = DTensor.from_local(stats, self.mesh, [Partial()], run_check=False).full_tensor()
        return total / self.mesh.size()
