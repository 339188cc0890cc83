"""FlexAttention BlockMasks built from our selection: one sequence, a packed batch under a token-level
document mask, and whole-block documents given exactly the kept blocks."""
from __future__ import annotations

import torch

from .common import B


def _dense_to_ordered(dense):
    """[1, H, NB, NB] bool -> (num [1, H, NB], indices [1, H, NB, NB]) with kept blocks first, ascending, and
    the rest of each row a permutation of the other blocks (what create_block_mask produces)."""
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def _diagonal_partial(dense, mask_mod, T: int, block: int):
    """BlockMask of the kept blocks ``dense`` [1, H, NB, NB] over T tokens: the diagonal blocks partial
    (``mask_mod`` is evaluated there), every other kept block full."""
    from torch.nn.attention.flex_attention import BlockMask

    eye = torch.eye(dense.shape[-1], dtype=torch.bool, device=dense.device)
    part_num, part_idx = _dense_to_ordered(dense & eye)
    full_num, full_idx = _dense_to_ordered(dense & ~eye)
    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def flex_block_mask_single(sel, H, L, B):
    """BlockMask for one sequence (blocks aligned with Flex's): diagonal = partial (causal mask_mod),
    other kept blocks = full."""
    dense = sel.to_dense_mask()[None]  # [1, H, NB, NB]
    assert dense.shape[1] == H
    sel_dense = dense[0]

    def mask_mod(b, h, q_idx, kv_idx):  # only evaluated on partial (diagonal) blocks by the fused kernel
        return (q_idx >= kv_idx) & sel_dense[h, q_idx // B, kv_idx // B]

    return _diagonal_partial(dense, mask_mod, L, B)


def flex_block_mask_packed(sel, H, T, B):
    from torch.nn.attention.flex_attention import create_block_mask

    lay = sel.layout
    dense = sel.to_dense_mask()  # [H, NB, NB]
    tok_doc = lay.block_doc[lay.token_block]
    tok_blk = lay.token_block

    def mask_mod(b, h, q_idx, kv_idx):
        same = tok_doc[q_idx] == tok_doc[kv_idx]
        return same & (kv_idx <= q_idx) & dense[h, tok_blk[q_idx], tok_blk[kv_idx]]

    dev = sel.q2k_idx.device
    return create_block_mask(mask_mod, 1, H, T, T, device=dev, BLOCK_SIZE=B, _compile=dev.type == "cuda")


def exact_block_mask(sel, Hq: int, kv_end: torch.Tensor):
    """BlockMask over a batch whose documents are whole blocks (aligned or padded) from our selection's kept
    blocks, per query head (each KV head's blocks for its group): kept blocks below the diagonal full, the
    diagonal partial, masked causally and past each document's real end ``kv_end`` (per token)."""
    dense = sel.to_dense_mask().repeat_interleave(Hq // sel.num_kv_heads, dim=0)[None]  # [1, Hq, NB, NB]

    def mask_mod(b, h, q_idx, kv_idx):  # evaluated on the diagonal blocks only
        return (q_idx >= kv_idx) & (kv_idx < kv_end[q_idx])

    return _diagonal_partial(dense, mask_mod, kv_end.numel(), B)
