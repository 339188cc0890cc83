"""Per-document block layout of a packed variable-length batch.

Documents are not aligned to block boundaries in the packed tensor, so blocks are defined per document:
block ``b`` of document ``i`` covers tokens ``[start_i + b*B, min(start_i + (b+1)*B, end_i))``. All blocks of
all documents form one global list (document-major), so global block ``g`` is both a query block and a
key/value block. Blocks tile ``[0, T)`` contiguously in order. Only the last block of a document can be partial.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "block_layout"]


@dataclass(frozen=True)
class BlockLayout:
    block_size: int
    num_docs: int
    num_blocks: int  # NB: total blocks over all documents
    total_tokens: int  # T
    doc_nblocks: tuple[int, ...]  # host: blocks per document
    doc_first_block: tuple[int, ...]  # host: global index of each document's first block (len n+1)
    doc_start: tuple[int, ...]  # host: cu_seqlens
    # device tensors
    block_start: torch.Tensor  # int32 [NB] first token of the block
    block_end: torch.Tensor  # int32 [NB] one past the last token
    block_doc: torch.Tensor  # int64 [NB] document of the block
    block_local: torch.Tensor  # int64 [NB] index of the block inside its document
    doc_first_block_t: torch.Tensor  # int64 [n+1]
    token_block: torch.Tensor  # int64 [T] global block of each token
    row_offset: torch.Tensor  # int64 [NB] start of block g's causal candidates in a packed triangle
    total_causal: int  # sum over documents of nb*(nb+1)/2
    doc_causal_t: torch.Tensor  # float32 [n] causal blocks per document (device, for stats)
    doc_nblocks_t: torch.Tensor  # float32 [n] blocks per document (device, for stats)
    # program schedules, longest rows first: a query block's dense row has local+1 blocks, a KV block's
    # reverse row nb-local; sparse rows keep roughly the same order, and the layout is all it depends on
    q_order: torch.Tensor  # int32 [NB]
    k_order: torch.Tensor  # int32 [NB]

    @property
    def max_doc_blocks(self) -> int:
        return max(self.doc_nblocks)

    def causal_blocks_per_doc(self) -> list[int]:
        return [nb * (nb + 1) // 2 for nb in self.doc_nblocks]


_CACHE: "OrderedDict[tuple, BlockLayout]" = OrderedDict()
_CACHE_SIZE = 16


def block_layout(cu_seqlens: torch.Tensor, block_size: int, device=None) -> BlockLayout:
    """Build (or fetch from a small LRU cache) the block layout of ``cu_seqlens``.

    Costs one device->host copy of ``cu_seqlens`` (n+1 ints) unless it is already on the host.
    """
    device = torch.device(device) if device is not None else cu_seqlens.device
    cu_host = cu_seqlens.detach().to("cpu", torch.int64)
    key = (tuple(cu_host.tolist()), int(block_size), str(device))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    B = int(block_size)
    starts = cu_host[:-1]
    ends = cu_host[1:]
    lengths = ends - starts
    nblocks = (lengths + B - 1) // B
    first = torch.zeros(len(nblocks) + 1, dtype=torch.int64)
    first[1:] = torch.cumsum(nblocks, 0)
    NB = int(first[-1])
    n = len(nblocks)
    block_doc = torch.repeat_interleave(torch.arange(n), nblocks)
    block_local = torch.arange(NB) - first[:-1][block_doc]
    block_start = starts[block_doc] + block_local * B
    block_end = torch.minimum(block_start + B, ends[block_doc])
    T = int(cu_host[-1])
    token_block = torch.repeat_interleave(torch.arange(NB), block_end - block_start)
    tri = nblocks * (nblocks + 1) // 2
    doc_tri = torch.zeros(n + 1, dtype=torch.int64)
    doc_tri[1:] = torch.cumsum(tri, 0)
    row_offset = doc_tri[:-1][block_doc] + block_local * (block_local + 1) // 2
    q_order = torch.argsort(-(block_local + 1), stable=True)
    k_order = torch.argsort(-(nblocks[block_doc] - block_local), stable=True)
    # non-blocking copies: host tensors are staged at once, and blocking ones would each sync the stream
    lay = BlockLayout(
        block_size=B,
        num_docs=n,
        num_blocks=NB,
        total_tokens=T,
        doc_nblocks=tuple(int(x) for x in nblocks),
        doc_first_block=tuple(int(x) for x in first),
        doc_start=tuple(int(x) for x in cu_host),
        block_start=block_start.to(device=device, dtype=torch.int32, non_blocking=True),
        block_end=block_end.to(device=device, dtype=torch.int32, non_blocking=True),
        block_doc=block_doc.to(device, non_blocking=True),
        block_local=block_local.to(device, non_blocking=True),
        doc_first_block_t=first.to(device, non_blocking=True),
        token_block=token_block.to(device, non_blocking=True),
        row_offset=row_offset.to(device, non_blocking=True),
        total_causal=int(doc_tri[-1]),
        doc_causal_t=tri.to(device=device, dtype=torch.float32, non_blocking=True),
        doc_nblocks_t=nblocks.to(device=device, dtype=torch.float32, non_blocking=True),
        q_order=q_order.to(device=device, dtype=torch.int32, non_blocking=True),
        k_order=k_order.to(device=device, dtype=torch.int32, non_blocking=True),
    )
    _CACHE[key] = lay
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return lay
