"""The documents of one packed micro-batch, checked once on the host and handed to every layer.

``VarlenBatch.from_cu_seqlens(cu_seqlens)`` reads the offsets once (one device->host copy where
``cu_seqlens`` lives on a GPU, once per micro-batch instead of once per layer), checks them, and keeps the
block layout of each block size it is asked for. ``select_blocks`` and ``sparse_attention`` take it wherever
they take ``cu_seqlens``; then they read no offsets at all, so that a layer's selection, forward and
backward never wait for the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import BlockLayout, block_layout

__all__ = ["VarlenBatch", "check_cu_type", "check_offsets"]


def check_cu_type(cu_seqlens) -> None:
    """A one-line ValueError unless ``cu_seqlens`` is a 1-D int32 tensor of at least two entries."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be an int32 tensor, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")


def check_offsets(cu_seqlens) -> list[int]:
    """The offsets of an int32 ``[n+1]`` tensor as host ints (one device->host copy for a device tensor),
    or a one-line ValueError naming the first bad entry."""
    check_cu_type(cu_seqlens)
    # plain Python over the host list: a few torch ops on tiny CPU tensors cost more host time
    vals = cu_seqlens.detach().cpu().tolist()
    if vals[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {vals[0]}")
    for i, (a, b) in enumerate(zip(vals, vals[1:], strict=False)):
        if b <= a:
            raise ValueError(f"cu_seqlens must be strictly increasing, got cu_seqlens[{i}]={a} >= "
                             f"cu_seqlens[{i + 1}]={b}")
    return vals


@dataclass(frozen=True, eq=False)
class VarlenBatch:
    """Checked offsets of one micro-batch's documents (document ``i`` is tokens ``[offsets[i],
    offsets[i+1])``) and their block layouts, built on first use per (block size, device)."""

    offsets: tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 [n+1] on the host
    _layouts: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> "VarlenBatch":
        vals = check_offsets(cu_seqlens)
        return cls(tuple(vals), torch.tensor(vals, dtype=torch.int32))

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def layout(self, block_size: int, device) -> BlockLayout:
        key = (int(block_size), str(torch.device(device)))
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = block_layout(self.cu_seqlens, block_size, device)
        return lay
