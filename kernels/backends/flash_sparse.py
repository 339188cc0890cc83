"""``fa4_sparse``: FlashAttention-4's block-sparse form on our block selection.

FlashAttention-4 (``flash_attn.cute``) computes the blocks that our selection (``select_blocks``, the same
routing and budgets as ``ours``) keeps; FlexAttention's FLASH backend (``flex_attention`` compiled, with
``kernel_options={"BACKEND": "FLASH"}``) hands them to it as a BlockMask. Flex tiles the whole batch into blocks
of ``block_size`` tokens, while our selection tiles each document from its start; so the documents are padded to
whole blocks, and block ``b`` of our layout is tile ``b`` of the padded batch. Every kept block below a
document's diagonal is full (no mask evaluated); each diagonal block is partial: causal, and no key past the
document's real end. The copies into and out of the padded batch, and the BlockMask, are part of the backend's
time, as a trainer pays them every layer.

The BlockMask means what FlexAttention's fused kernels make of it (unkept blocks skipped, the mask evaluated on
partial blocks only); its eager reference evaluates the mask alone, everywhere, so the backend always compiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .base import cu_seqlens, register, require_cuda
from .flash import installed

if TYPE_CHECKING:
    import torch

FLASH_OPTIONS = {"BACKEND": "FLASH"}


@dataclass(frozen=True)
class PaddedDocuments:
    """A micro-batch's documents as ``fa4_sparse`` takes them: ``batch`` (the real documents, what our selection
    takes), ``positions`` (``[T]`` each real token's row in the padded batch) and ``kv_end`` (``[T_pad]`` each
    padded row's document end, in padded rows)."""

    batch: object  # kernels.sparse_attention.VarlenBatch
    positions: torch.Tensor
    kv_end: torch.Tensor

    @property
    def padded_tokens(self) -> int:
        return self.kv_end.numel()


def padded_documents(lengths: Sequence[int], block_size: int, device) -> PaddedDocuments:
    """The documents ``lengths`` padded to whole blocks of ``block_size`` tokens."""
    import torch

    from sparsebalance.kernels.sparse_attention import VarlenBatch

    lens = torch.tensor(list(lengths), dtype=torch.int64)
    padded = -(-lens // block_size) * block_size
    starts = torch.cumsum(padded, 0) - padded
    doc = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    offset = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[doc]
    positions = starts[doc] + offset
    kv_end = torch.repeat_interleave(starts + lens, padded).to(torch.int32)
    return PaddedDocuments(VarlenBatch.from_cu_seqlens(cu_seqlens(lens.tolist())), positions.to(device),
                           kv_end.to(device))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, H, R, C]`` bool -> (counts ``[1, H, R]``, indices ``[1, H, R, C]``), int32: each row's kept columns
    first, ascending, zeros after them (the kernels read a row's first ``count`` entries only). A running count
    gives each kept column its slot, so no sort runs: the mask is built every layer, inside the timed call."""
    import torch

    columns = dense.shape[-1]
    slot = torch.where(dense, dense.cumsum(-1, dtype=torch.int32) - 1, columns)  # the unkept to a spare slot
    indices = torch.zeros(*dense.shape[:-1], columns + 1, dtype=torch.int32, device=dense.device)
    indices.scatter_(-1, slot.long(), torch.arange(columns, dtype=torch.int32, device=dense.device).expand_as(slot))
    return dense.sum(-1, dtype=torch.int32), indices[..., :columns].contiguous()


def diagonal_partial_mask(dense: torch.Tensor, mask_mod, tokens: int, block_size: int):
    """The BlockMask of the kept blocks ``dense`` ``[1, H, NB, NB]`` over ``tokens`` rows: the diagonal blocks
    partial (``mask_mod`` evaluated there), every other kept block full; the query-side lists (the backward's)
    from the same blocks transposed."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    eye = torch.eye(dense.shape[-1], dtype=torch.bool, device=dense.device)
    partial, full = dense & eye, dense & ~eye
    return BlockMask((tokens, tokens), *_ordered(partial), *_ordered(full), *_ordered(partial.transpose(-2, -1)),
                     *_ordered(full.transpose(-2, -1)), BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod)


def selection_block_mask(selection, query_heads: int, kv_end: torch.Tensor):
    """The BlockMask of ``selection``'s kept blocks over a batch whose documents are whole blocks (padded, each
    row's document end ``kv_end``), per query head (each KV head's blocks for its group): the diagonal blocks
    partial, masked causally and past each document's real end, every other kept block full."""
    dense = selection.to_dense_mask().repeat_interleave(query_heads // selection.num_kv_heads, dim=0)[None]

    def mask_mod(b, h, q_idx, kv_idx):  # evaluated on the diagonal blocks only
        return (q_idx >= kv_idx) & (kv_idx < kv_end[q_idx])

    return diagonal_partial_mask(dense, mask_mod, kv_end.numel(), selection.block_size)


def padded_block_sparse(q, k, v, docs: PaddedDocuments, selection, flex, kernel_options=None):
    """Causal attention of ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` over ``selection``'s kept blocks: the
    documents padded to whole blocks, ``flex`` (compiled FlexAttention) on the BlockMask, the real rows taken
    back. ``[T, Hq, D]``, differentiable for q, k and v."""
    import torch

    mask = selection_block_mask(selection, q.shape[1], docs.kv_end)

    def padded(x):  # [1, H, T_pad, D], a view of [T_pad, H, D]: FlashAttention's own (batch, seq, head) layout
        rows = torch.zeros(docs.padded_tokens, *x.shape[1:], dtype=x.dtype, device=x.device)
        return rows.index_copy(0, docs.positions, x).transpose(0, 1).unsqueeze(0)

    opts = {"kernel_options": kernel_options} if kernel_options else {}
    out = flex(padded(q), padded(k), padded(v), block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], **opts)
    return out[0].transpose(0, 1).index_select(0, docs.positions)


@register("fa4_sparse")
class FlashAttention4Sparse:
    sparse = True
    # Each call pads the documents, builds the BlockMask and dispatches the compiled FlexAttention on the host, which
    # the GPU waits on in training: its calibration is timed on the event clock (calibrate/README.md)
    host_work = True

    def __init__(self, block_size: int = 128) -> None:
        self.block_size = block_size  # the calibrated profile's (conf/cost), as ours

    def check(self) -> None:
        import torch

        import flash_attn.cute  # noqa: F401  (FLASH's kernels; FlexAttention imports them only when compiling)
        from torch.nn.attention.flex_attention import flex_attention

        require_cuda()
        # one compiled function for every micro-batch, whatever its padded length (a static compile per length
        # would reach dynamo's recompile limit within a training run)
        self.flex = torch.compile(flex_attention, dynamic=True)

    def version(self) -> str:
        import torch

        return (f"{installed('flash-attn-4')}, {installed('nvidia-cutlass-dsl')}, FlexAttention FLASH (torch "
                f"{torch.__version__}) on our selection")

    def documents(self, lengths: Sequence[int], device) -> PaddedDocuments:
        return padded_documents(lengths, self.block_size, device)

    def select(self, q, k, docs: PaddedDocuments, **budget):
        from sparsebalance.kernels.sparse_attention import select_blocks

        return select_blocks(q, k, docs.batch, block_size=self.block_size, **budget)

    def attention(self, q, k, v, docs: PaddedDocuments, kept_fraction: float = 1.0, selection=None):
        if selection is None:
            selection = self.select(q, k, docs, kept_fraction=kept_fraction)
        return padded_block_sparse(q, k, v, docs, selection, self.flex, FLASH_OPTIONS)
