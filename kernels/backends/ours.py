"""``ours``: the block-sparse Triton kernel (:mod:`kernels.sparse_attention`), dense unless given a kept
fraction; on CPU tensors its PyTorch reference."""
from __future__ import annotations

from typing import Sequence

from .base import cu_seqlens, register


@register("ours")
class Ours:
    sparse = True
    host_work = False

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size  # the calibrated profile's (conf/cost)

    def check(self) -> None:
        from sparsebalance.kernels import sparse_attention  # noqa: F401  (Triton and the kernels)

    def version(self) -> str:
        import torch
        import triton

        return f"kernels.sparse_attention (triton {triton.__version__}, torch {torch.__version__})"

    def documents(self, lengths: Sequence[int], device) -> object:
        from sparsebalance.kernels.sparse_attention import VarlenBatch

        return VarlenBatch.from_cu_seqlens(cu_seqlens(lengths))

    def select(self, q, k, docs, **budget):
        from sparsebalance.kernels.sparse_attention import select_blocks

        return select_blocks(q, k, docs, block_size=self.block_size, **budget)

    def attention(self, q, k, v, docs, kept_fraction: float = 1.0, selection=None):
        from sparsebalance.kernels.sparse_attention import sparse_attention

        if selection is not None:
            return sparse_attention(q, k, v, docs, selection=selection)
        return sparse_attention(q, k, v, docs, kept_fraction=kept_fraction, block_size=self.block_size)
